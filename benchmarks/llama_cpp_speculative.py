"""edgeinfer's speculative decoding beside llama.cpp's own, on the same GGUF files and prompts.

llama.cpp's side is its ``llama-speculative-simple`` example, built from the llama.cpp that
the installed llama-cpp-python vendors: its source package is fetched from the package
index and built once (Release, CPU, the build's default native flags) under
``$EDGEINFER_HOME/peers/llama.cpp-<version>-src``. It runs two of llama.cpp's own methods:

- ``draft-simple``: ``--spec-type draft-simple -md DRAFT`` (a draft model; llama.cpp's
  default draft settings);
- ``ngram-simple``: ``--spec-type ngram-simple`` (drafts from n-grams of the context: the
  counterpart of prompt lookup).

edgeinfer's side is ``benchmarks/speculative.py``'s worker on the llama.cpp route
(``engine="llama.cpp"``, the same files; ``--route onnx``: the default route, onnxruntime on
the exact transcode of the same file): plain decoding and the settings asked for. Both
run the same prompts (edgeinfer's chat template rendering, which the peer reads with
special tokens parsed), greedy, the same new-token limit, threads and context; the
extraction task gives the peer the same JSON schema (``-j``). Rounds alternate: one
edgeinfer process, then every peer run (one process each, as the example works).

Decode tokens/s: edgeinfer's ``stats.decode_tokens_per_s`` ((n - 1) tokens over first to
last token); the peer's own "decoded N tokens in T seconds" (after its prompt pass). Per
task: the medians, and edgeinfer's setting over the peer's method it is paired with
(``--pairs``).

    python benchmarks/llama_cpp_speculative.py --build-only
    python benchmarks/llama_cpp_speculative.py --model qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct --per-task 3 --rounds 2 \\
        -o benchmarks/results/llama_cpp_speculative.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conditions
import speculative

BINARY = "llama-speculative-simple"
PEER_METHODS = ("draft-simple", "ngram-simple")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_COUNTS = {key: re.compile(rf"\b{key}\s*=\s*(\d+)") for key in ("n_drafted", "n_accept")}


def source_dir() -> Path:
    from edgeinfer.files.catalog import edgeinfer_home

    version = metadata.version("llama_cpp_python")
    return edgeinfer_home() / "peers" / f"llama.cpp-{version}-src"


def build() -> Path:
    """The peer binary, built once from llama-cpp-python's own source package."""
    src = source_dir()
    binary = src / "build" / "bin" / BINARY
    if binary.exists():
        return binary
    version = metadata.version("llama_cpp_python")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}",
                        "--no-binary", ":all:", "--no-deps", "-d", tmp], check=True)  # fmt: skip
        (archive,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix) :]
            tar.extractall(src.with_suffix(".part"), members=[m for m in members if m.name],
                           filter="data")  # fmt: skip
        src.with_suffix(".part").rename(src)
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_OPENSSL=OFF"],
                   check=True)  # fmt: skip
    subprocess.run(["cmake", "--build", str(src / "build"), "-j2", "--target", BINARY], check=True)
    return binary


def peer_run(binary: Path, method: str, prompt: str, plain: str, schema: dict[str, Any] | None,
             args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """One generation by the peer: decode tokens/s, drafted and accepted tokens, and whether
    its text holds edgeinfer's plain decoding's (``plain``) whole."""
    from edgeinfer.files.catalog import local_path, lookup

    def gguf(name: str) -> str:
        entry = lookup(name)
        return str(local_path(entry)) if entry is not None else name

    # -p, not -f: a prompt file loses its final newline (the chat template's, after
    # "assistant") when llama.cpp reads it
    argv = [str(binary), "-m", gguf(args.model), "-p", prompt, "-n", str(args.max_new_tokens),
            "-c", "1024", "-t", str(args.threads), "-tb", str(args.threads), "--temp", "0",
            ]  # fmt: skip
    argv += ["--spec-type", method]
    if method == "draft-simple":
        argv += ["-md", gguf(args.draft), "-td", str(args.threads), "-tbd", str(args.threads)]
    if schema is not None:
        argv += ["-j", json.dumps(schema)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    found = _DECODED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{BINARY} failed ({done.returncode}): {done.stderr[-2000:]}")
    tokens, seconds = int(found.group(1)), float(found.group(2))
    counts = {k: int(m.group(1)) if (m := rx.search(done.stderr)) else 0
              for k, rx in _COUNTS.items()}  # fmt: skip
    rate = tokens / seconds if seconds else 0.0
    return {"method": method, "tokens": tokens, "decode_tok_s": rate,
            "drafted": counts["n_drafted"], "accepted": counts["n_accept"],
            "same_as_plain": bool(plain) and plain.strip() in done.stdout}  # fmt: skip


def one_round(binary: Path, args: argparse.Namespace, n: int) -> dict[str, Any]:
    settings = ("off", *args.settings.split(","))
    if args.draft:
        settings += (f"draft:{args.draft}",)
    argv = [sys.executable, speculative.__file__, "--worker", args.route,
            "--threads", str(args.threads), "--max-new-tokens", str(args.max_new_tokens),
            "--model", args.model, "--settings", ",".join(settings),
            "--per-task", str(args.per_task)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    mine = json.loads(done.stdout.splitlines()[-1])
    fields = {task: requests for task, requests in speculative.tasks().items()}
    peer = []
    methods = [m for m in PEER_METHODS if args.draft or m != "draft-simple"]
    for run in mine["runs"]:
        if run["setting"] != "off":
            continue
        request = fields[run["task"]][run["prompt"]]
        fmt = request.get("response_format")
        schema = fmt["json_schema"]["schema"] if fmt else None
        for method in methods:
            r = peer_run(binary, method, run["prompt_text"], run["text"], schema, args)
            peer.append({"task": run["task"], "prompt": run["prompt"], "round": n, **r})
    return {"round": n, "edgeinfer": mine, "peer": peer}


def summarize(rounds: list[dict[str, Any]], pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Per task: median decode tokens/s of each edgeinfer setting and peer method, and each
    pair's ratio (edgeinfer's over the peer's, per prompt and round, then the median)."""
    table: dict[str, Any] = {}
    mine = [dict(r, round=x["round"]) for x in rounds for r in x["edgeinfer"]["runs"]]
    peer = [r for x in rounds for r in x["peer"]]
    for task in dict.fromkeys(r["task"] for r in mine):
        row: dict[str, Any] = {}
        for setting in dict.fromkeys(r["setting"] for r in mine):
            rates = [
                r["decode_tok_s"] for r in mine if (r["task"], r["setting"]) == (task, setting)
            ]
            row[f"edgeinfer {setting}"] = statistics.median(rates)
        for method in dict.fromkeys(r["method"] for r in peer):
            these = [r for r in peer if (r["task"], r["method"]) == (task, method)]
            row[f"llama.cpp {method}"] = statistics.median(r["decode_tok_s"] for r in these)
            drafted = sum(r["drafted"] for r in these)
            row[f"llama.cpp {method} acceptance"] = (
                sum(r["accepted"] for r in these) / drafted if drafted else None
            )
        for setting, method in pairs:
            ratios = []
            for p in (r for r in peer if (r["task"], r["method"]) == (task, method)):
                m = next((r for r in mine if (r["task"], r["prompt"], r["round"], r["setting"])
                          == (task, p["prompt"], p["round"], setting)), None)  # fmt: skip
                if m is not None and p["decode_tok_s"]:
                    ratios.append(m["decode_tok_s"] / p["decode_tok_s"])
            if ratios:
                row[f"{setting} / {method}"] = statistics.median(ratios)
        table[task] = row
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="", help="a draft model (catalog name); none: ngram only")
    p.add_argument("--settings", default="lookup,auto", help="edgeinfer's, beside plain")
    p.add_argument("--pairs", default="",
                   help="SETTING=METHOD,... (default: auto and lookup with ngram-simple, the "
                   "draft with draft-simple)")  # fmt: skip
    p.add_argument("--route", choices=sorted(speculative.ROUTES), default="gguf",
                   help="edgeinfer's route: gguf (llama.cpp, the file itself) or onnx (the "
                   "default route: its exact transcode of the same file)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--per-task", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--build-only", action="store_true", help="build the peer and stop")
    p.add_argument("-o", "--out", type=Path,
                   default=Path("benchmarks/results/llama_cpp_speculative.json"))  # fmt: skip
    args = p.parse_args()
    binary = build()
    if args.build_only:
        print(binary)
        return
    if args.pairs:
        pairs = [tuple(x.split("=", 1)) for x in args.pairs.split(",")]
    else:
        pairs = [(s, "ngram-simple") for s in args.settings.split(",")]
        if args.draft:
            pairs.append((f"draft:{args.draft}", "draft-simple"))
    run = conditions.start(args.threads, args.rounds)
    rounds = []
    for n in range(args.rounds):
        rounds.append(one_round(binary, args, n))
        print(f"round {n + 1}/{args.rounds} done", file=sys.stderr)
    source = f"llama-cpp-python=={metadata.version('llama_cpp_python')} sdist, vendor/llama.cpp"
    result = {"conditions": conditions.finish(run), "model": args.model, "draft": args.draft,
              "route": speculative.ROUTES[args.route],
              "peer": {"binary": BINARY, "source": source, "methods": PEER_METHODS},
              "pairs": pairs, "summary": summarize(rounds, pairs), "rounds": rounds}  # fmt: skip
    conditions.write(args.out, result)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
