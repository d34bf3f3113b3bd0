"""``edgeinfer models list|fetch|path``: the catalog, and which of its models are here."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import InvalidRequestError
from ..files import catalog


def add_parser(sub: Any) -> None:
    models = sub.add_parser("models", help="list, fetch or locate catalog models")
    msub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    msub.add_parser("list", help="catalog entries and which are present")
    fetch = msub.add_parser("fetch", help="download a catalog model into $EDGEINFER_HOME")
    fetch.add_argument("name", metavar="NAME")
    fetch.add_argument("--force", action="store_true", help="fetch again even if present")
    path = msub.add_parser("path", help="print the local path of a catalog model")
    path.add_argument("name", metavar="NAME")


def cmd_models(args: argparse.Namespace) -> int:
    if args.models_command == "list":
        _print_list()
        return 0
    entry = catalog.lookup(args.name)
    if entry is None:
        raise InvalidRequestError(
            f"{args.name!r} is not in the catalog; see 'edgeinfer models list'"
        )
    if args.models_command == "fetch":
        print(catalog.fetch(args.name, force=args.force))
        return 0
    if not catalog.is_present(entry):
        raise InvalidRequestError(
            f"{args.name} is not fetched yet; run 'edgeinfer models fetch {args.name}'"
        )
    print(catalog.local_path(entry))
    return 0


def _print_list() -> None:
    print(f"{'NAME':<28} {'KIND':<5} {'SIZE':>7}  {'STATUS':<12}  DESCRIPTION")
    for listed in catalog.CATALOG.values():
        size = f"{listed.size / 1e6:.0f} MB" if listed.size else ""
        row = f"{listed.name:<28} {listed.format:<5} {size:>7}  {_status(listed):<12}"
        print(f"{row}  {listed.description}")
        transcode = _transcode_line(listed)
        if transcode:
            print(f"{'':<28} {transcode}")


def _status(entry: catalog.CatalogEntry) -> str:
    """present, not fetched, or for a chunked model a stopped fetch's parts ("partial 5/22")."""
    if catalog.is_present(entry):
        return "present"
    if entry.is_chunked:
        from ..files.catalog_chunks import partial_parts

        kept = partial_parts(entry, catalog.local_path(entry))
        if kept is not None:
            return f"partial {kept}/{entry.parts}"
    return "not fetched"


def _transcode_line(entry: catalog.CatalogEntry) -> str | None:
    """The ONNX folder ``load()`` built from this GGUF, if any, and whether it was checked."""
    from ..errors import EdgeInferError
    from ..files.manifest import MANIFEST_NAME, Manifest
    from ..files.source import ModelSource
    from ..loader import native_folder_for

    if entry.format != "gguf" or entry.sha256 is None:
        return None
    folder = native_folder_for(ModelSource(entry.name, catalog.local_path(entry), "gguf", None))
    if not (folder / MANIFEST_NAME).is_file():
        return None
    try:
        summary = Manifest.read(folder).validation_summary()
    except EdgeInferError as exc:
        summary = f"unreadable: {exc}"
    return f"onnx transcode at {folder}: {summary}"
