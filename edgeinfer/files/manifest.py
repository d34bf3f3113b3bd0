"""``edgeinfer.json``: what a converted model folder holds, written by the converters and read
by the runtimes and the memory planner. Only the standard library is needed to read it.

A model folder may come from a stranger, so reading it is a trust edge: ``parse_manifest``
checks every field's type and range before any dataclass is built, and ``resolve_inside``
keeps every file the manifest names inside the folder. Keys this version does not know are
ignored (with a warning), so that a newer writer of the same ``format_version`` stays readable;
a missing required key or a wrong value is a ``ModelLoadError`` naming the field.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, NoReturn

from ..errors import ModelLoadError, short_repr

__all__ = [
    "ARCHITECTURE_LIMITS",
    "KV_CACHE_LAYOUTS",
    "KV_DTYPES",
    "MANIFEST_NAME",
    "PARTIAL_MARKER",
    "Architecture",
    "Manifest",
    "parse_manifest",
    "resolve_inside",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "edgeinfer.json"
PARTIAL_MARKER = ".edgeinfer-partial"  # present only in an unfinished conversion's folder
FORMAT_VERSION = 1
KV_DTYPES = ("float32", "float16")
KV_CACHE_LAYOUTS = ("grow", "shared")
_MAX_MANIFEST_BYTES = 1 << 20  # converters write ~1 KB; more is not a manifest
_MAX_EOS_IDS = 256
_MAX_NAME_CHARS = 1024
# Upper bound of every architecture integer (the lower bound is 1): far beyond any real
# model, small enough that the sizes derived from them (KV cache, logits buffers) stay sane.
ARCHITECTURE_LIMITS: dict[str, int] = {
    "num_layers": 1024,
    "num_kv_heads": 1024,
    "head_dim": 8192,
    "hidden_size": 1 << 17,
    "max_context": 1 << 24,
    "vocab_size": 1 << 22,
}
_MISSING = object()


NOT_CHECKED = "built without comparing its answers with its source"


@dataclass(frozen=True)
class Architecture:
    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_context: int
    vocab_size: int
    kv_dtype: str = "float32"  # element type of the KV cache the graph takes and returns
    # "grow": each run returns the cache grown by the new tokens (optimum's graphs);
    # "shared": past and present are one buffer of the whole context, written in place
    # (GroupQueryAttention graphs of the native builder and onnxruntime-genai)
    kv_cache: str = "grow"


@dataclass(frozen=True)
class Manifest:
    format: str  # "onnx"
    model_file: str
    architecture: Architecture
    tokenizer_file: str = "tokenizer.json"
    chat_template_file: str | None = "chat_template.jinja"
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    has_position_ids: bool = True
    source: dict[str, Any] = field(default_factory=dict)
    quantization: dict[str, Any] = field(default_factory=dict)
    validation: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def write(self, folder: Path) -> None:
        data = asdict(self)
        if not data["validation"]:  # say so: a folder nobody compared with its source
            data["validation"] = {"skipped": NOT_CHECKED}
        (folder / MANIFEST_NAME).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")

    def validation_summary(self) -> str:
        """One line: what the folder was checked against, or that it was not."""
        report = self.validation
        if not report or "skipped" in report:
            return f"not validated ({report.get('skipped', NOT_CHECKED)})"
        if report.get("passed") is False:
            return "failed validation"
        against = report.get("reference", "its source")
        top1 = report.get("top1_agreement")
        figures = f", top-1 {100 * float(top1):.1f}%" if isinstance(top1, int | float) else ""
        return f"validated against {against}{figures}"

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """The folder's manifest, validated, with every file it names inside the folder."""
        if (folder / PARTIAL_MARKER).exists():
            raise ModelLoadError(
                f"{folder} is an unfinished conversion (interrupted or failed); delete it and "
                "convert again"
            )
        path = folder / MANIFEST_NAME
        resolve_inside(folder, MANIFEST_NAME, MANIFEST_NAME, where=str(folder))
        manifest = parse_manifest(_read_json(path), where=str(path))
        manifest.check_files(folder, where=str(path))
        return manifest

    def check_files(self, folder: Path, *, where: str) -> None:
        """Every file this manifest names must lie inside ``folder`` (symlinks resolved)."""
        for name, key in self.named_files():
            resolve_inside(folder, name, key, where=where)

    def named_files(self) -> list[tuple[str, str]]:
        """(file name, manifest key) of every file this manifest names."""
        files = [(self.model_file, "model_file"), (self.tokenizer_file, "tokenizer_file")]
        if self.chat_template_file is not None:
            files.append((self.chat_template_file, "chat_template_file"))
        return files


def _read_json(path: Path) -> Any:
    try:
        if path.exists() and not path.is_file():  # a folder, a FIFO that would block forever
            raise ModelLoadError(f"{path} is not a regular file")
        size = path.stat().st_size
        if size > _MAX_MANIFEST_BYTES:
            raise ModelLoadError(
                f"{path} is {size:,} bytes, not a manifest (at most {_MAX_MANIFEST_BYTES:,})"
            )
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(
            f"{path.parent} has no {MANIFEST_NAME}: convert the model with 'edgeinfer convert'"
        ) from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, nesting too deep
        raise ModelLoadError(f"{path} is not valid JSON ({exc}); re-convert the model") from exc


def parse_manifest(data: Any, *, where: str = MANIFEST_NAME) -> Manifest:
    """Validate a decoded ``edgeinfer.json`` as a whole, then build the Manifest."""
    top = _Fields(data, where, "")
    version = top.get("format_version", FORMAT_VERSION)
    if type(version) is int and version > FORMAT_VERSION:
        raise ModelLoadError(
            f"{where} was written by a newer edgeinfer (format {version}, this version reads "
            f"up to {FORMAT_VERSION}); upgrade edgeinfer"
        )
    version = top.integer("format_version", 1, FORMAT_VERSION, default=FORMAT_VERSION)
    if top.get("format") != "onnx":
        top.fail("format", top.get("format"), 'must be "onnx"')
    arch = _parse_architecture(_Fields(top.mapping("architecture"), where, "architecture."))
    manifest = Manifest(
        format="onnx",
        model_file=top.file_name("model_file"),
        architecture=arch,
        tokenizer_file=top.file_name("tokenizer_file", "tokenizer.json"),
        chat_template_file=top.file_name("chat_template_file", "chat_template.jinja", True),
        bos_token=top.text("bos_token", None),
        eos_token=top.text("eos_token", None),
        eos_token_ids=top.token_ids("eos_token_ids", arch.vocab_size),
        has_position_ids=top.boolean("has_position_ids", True),
        source=dict(top.mapping("source", {})),
        quantization=dict(top.mapping("quantization", {})),
        validation=dict(top.mapping("validation", {})),
        format_version=version,
    )
    method = manifest.quantization.get("method", "")
    if not isinstance(method, str):
        top.fail("quantization.method", method, "must be a string")
    top.warn_unknown({f.name for f in Manifest.__dataclass_fields__.values()})
    return manifest


def _parse_architecture(fields: _Fields) -> Architecture:
    numbers = {key: fields.integer(key, 1, top) for key, top in ARCHITECTURE_LIMITS.items()}
    kv_dtype = fields.text("kv_dtype", "float32")
    if kv_dtype not in KV_DTYPES:
        fields.fail("kv_dtype", kv_dtype, f"must be one of {', '.join(KV_DTYPES)}")
    kv_cache = fields.text("kv_cache", "grow")
    if kv_cache not in KV_CACHE_LAYOUTS:
        fields.fail("kv_cache", kv_cache, f"must be one of {', '.join(KV_CACHE_LAYOUTS)}")
    model_type = fields.text("model_type")
    fields.warn_unknown(set(Architecture.__dataclass_fields__))
    return Architecture(model_type=model_type, kv_dtype=kv_dtype, kv_cache=kv_cache, **numbers)


class _Fields:
    """Typed access to one JSON object's keys; every failure names ``prefix + key``."""

    def __init__(self, data: Any, where: str, prefix: str) -> None:
        self.where, self.prefix = where, prefix
        if not isinstance(data, Mapping):
            self.fail("", data, "must be a JSON object")
        self.data: Mapping[str, Any] = data

    def fail(self, key: str, value: Any, why: str) -> NoReturn:
        name = (self.prefix + key).rstrip(".") or "the manifest"
        raise ModelLoadError(
            f"{self.where}: {name}={short_repr(value)} {why}; the manifest is damaged or was "
            "not written by edgeinfer — re-convert the model"
        )

    def get(self, key: str, default: Any = _MISSING) -> Any:
        value = self.data.get(key, default)
        if value is _MISSING:
            self.fail(key, None, "is missing")
        return value

    def integer(self, key: str, low: int, high: int, default: Any = _MISSING) -> int:
        value = self.get(key, default)
        if type(value) is not int or not low <= value <= high:
            self.fail(key, value, f"must be an integer from {low} to {high:,}")
        return int(value)

    def text(self, key: str, default: Any = _MISSING) -> Any:
        value = self.get(key, default)
        nullable = default is None
        if not (isinstance(value, str) or (nullable and value is None)):
            self.fail(key, value, "must be a string" + (" or null" if nullable else ""))
        if isinstance(value, str) and ("\0" in value or len(value) > _MAX_NAME_CHARS):
            self.fail(key, value, f"must be text without NUL, at most {_MAX_NAME_CHARS} chars")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            self.fail(key, value, "must be true or false")
        return bool(value)

    def mapping(self, key: str, default: Any = _MISSING) -> Mapping[str, Any]:
        value = self.get(key, default)
        if not isinstance(value, Mapping):
            self.fail(key, value, "must be a JSON object")
        return value

    def token_ids(self, key: str, vocab_size: int) -> tuple[int, ...]:
        value = self.get(key, [])
        if not isinstance(value, list) or len(value) > _MAX_EOS_IDS:
            self.fail(key, value, f"must be a list of at most {_MAX_EOS_IDS} token ids")
        for item in value:
            if type(item) is not int or not 0 <= item < vocab_size:
                self.fail(key, value, f"must hold integers from 0 to {vocab_size - 1:,}")
        return tuple(value)

    def file_name(self, key: str, default: Any = _MISSING, optional: bool = False) -> Any:
        value = self.get(key, default)
        if value is None and optional:
            return None
        if not isinstance(value, str):
            self.fail(key, value, "must be a file name" + (" or null" if optional else ""))
        problem = _name_problem(value)
        if problem:
            self.fail(key, value, problem)
        return value

    def warn_unknown(self, known: set[str]) -> None:
        unknown = sorted(str(k) for k in self.data if k not in known)
        if unknown:
            logger.warning(
                "%s: ignoring keys this edgeinfer version does not know: %s",
                self.where,
                ", ".join(self.prefix + k for k in unknown[:8]),
            )


def _name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a relative file name inside a folder, or None if it can."""
    if not name or not name.strip():
        return "must be a non-empty file name"
    if "\0" in name or len(name) > _MAX_NAME_CHARS:
        return f"must be a file name without NUL, at most {_MAX_NAME_CHARS} chars"
    windows = PureWindowsPath(name)
    # Backslashes and drive letters are checked on every OS: the folder may travel to Windows.
    if PurePosixPath(name).is_absolute() or windows.is_absolute() or windows.drive:
        return "must be a path relative to the model folder, not an absolute path"
    if ".." in windows.parts or ".." in PurePosixPath(name).parts:
        return "must not leave the model folder ('..')"
    return None


def resolve_inside(folder: Path, name: str, key: str, *, where: str | None = None) -> Path:
    """The real path of ``name`` inside ``folder`` (symlinks resolved).

    Raises ModelLoadError naming ``key`` (and ``where`` it was read, by default the folder's
    manifest) if the name is not a plain relative name or if it, or a symlink on its way,
    leads outside the folder. The file need not exist.
    """
    where = where or str(folder / MANIFEST_NAME)
    problem = _name_problem(name) if isinstance(name, str) else "must be a file name"
    if problem:
        raise ModelLoadError(f"{where}: {key}={short_repr(name)} {problem}")
    try:
        root = folder.resolve()
        target = (root / name).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # symlink loops, names too long
        raise ModelLoadError(f"{where}: cannot resolve {key}={name!r}: {exc}") from exc
    if target == root or not target.is_relative_to(root):
        # the target is not named: where a stranger's symlink points is none of our output
        raise ModelLoadError(
            f"{where}: {key}={name!r} leads outside the model folder {folder} (through a "
            "symlink); every file a model names must lie inside its folder"
        )
    return target
