"""Speculative decoding against plain decoding: the same requests, the same process, in turn.

Tasks (10 prompts each, 50 in all): summarize a given text, extract fields as JSON under a schema,
rewrite a paragraph, edit a given function (input-grounded: the reply copies from the
prompt), and open chat. For each route (the ONNX transcode and llama.cpp on the catalog
GGUF) one process per round loads the model, warms it up, then runs every prompt with each
setting in turn ("off", "lookup", "auto"), greedy, 128 new tokens at most. Reported per task
and setting: median decode tokens/s over plain's (per prompt, then the median), drafted and
accepted tokens, and the share of replies whose token ids equal plain decoding's.

    python benchmarks/speculative.py --rounds 3 --threads 2 \
        -o benchmarks/results/speculative.json
    python benchmarks/speculative.py --model qwen2.5-coder-1.5b-instruct --routes gguf \
        --settings off,lookup,draft:qwen2.5-coder-0.5b-instruct --per-task 3 --rounds 2 \
        -o benchmarks/results/speculative-1.5b.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conditions

SETTINGS = ("off", "lookup", "auto")
ROUTES = {"onnx": "onnxruntime", "gguf": "llama.cpp"}

TEXTS = [
    "The river town of Alder Ford holds a market every Saturday. Farmers bring apples, "
    "cheese and honey from the hills, and the baker sells rye bread from a cart by the "
    "bridge. In winter the market moves into the old grain hall, where a stove keeps the "
    "stalls warm and a fiddler plays until noon.",
    "A bicycle chain wears slowly: each link stretches a little as its pins and rollers rub. "
    "A stretched chain skips on new sprockets and wears old ones faster. Measure it with a "
    "chain checker every few months; replace it at 0.5 percent stretch on eleven-speed "
    "drivetrains and at 0.75 percent on older ones.",
    "The city library opened its new reading room in March. It has forty desks, a corner for "
    "children with low shelves, and a wall of windows facing the park. The room is open from "
    "eight in the morning to nine at night, and on Sundays from noon to six.",
    "Tomatoes need six to eight hours of sun a day and steady water. Water them at the base "
    "in the morning, not on the leaves, to keep blight away. Pinch the side shoots of tall "
    "varieties so the plant puts its strength into fruit, and tie the stem to a stake as it "
    "grows.",
    "The night train leaves the capital at ten and reaches the coast at six. Each carriage has "
    "twelve cabins with two beds, a washbasin and a small table. Breakfast is served in the "
    "dining car from five, and passengers may leave their luggage at the station until noon.",
    "Our team moved the weekly meeting from Monday to Wednesday at ten. The meeting lasts half "
    "an hour; each person says what they finished, what they will do next and what blocks "
    "them. Notes go into the shared folder the same day, and anyone who misses the meeting "
    "reads them before Thursday.",
    "The museum's new exhibit shows clocks from four centuries: a water clock from a temple, "
    "a brass pendulum clock made in a village workshop, a ship's chronometer that crossed the "
    "ocean nine times, and a quartz watch from a factory that closed long ago.",
    "To make a simple bread, mix five hundred grams of flour, ten grams of salt, seven grams "
    "of yeast and three hundred and fifty grams of warm water. Knead for ten minutes, let it "
    "rise for an hour, shape it, let it rise again, and bake at two hundred and thirty "
    "degrees for thirty five minutes.",
    "The lighthouse on the north cape was built of grey stone in a single summer. Its lamp "
    "was first lit by oil, then by gas, and since the war by electricity. A keeper lived in "
    "the cottage below it until the light was automated, and the cottage now rents rooms to "
    "walkers on the coastal path.",
    "A good backup keeps three copies of your files on two kinds of storage, with one copy in "
    "another place. Test a restore every few months: a backup that has never been restored "
    "is only a hope. Keep the backup drive unplugged when it is not in use, so a fault or a "
    "virus on the computer cannot reach it.",
]
RECORDS = [
    ("Maria Lopez", "Valencia", 1987), ("Tomas Berg", "Uppsala", 1990),
    ("Aiko Tanaka", "Sendai", 1979), ("Omar Haddad", "Amman", 2001),
    ("Grace Mensah", "Kumasi", 1995), ("Lukas Novak", "Brno", 1983),
    ("Ines Duarte", "Porto", 1999), ("Pavel Orlov", "Kazan", 1975),
    ("Nadia Karim", "Tunis", 1992), ("Erik Lund", "Bergen", 1968),
]  # fmt: skip
FUNCTIONS = [
    "def total(items):\n    x = 0\n    for item in items:\n        x = x + item.price\n"
    "    return x\n",
    "def count_words(text):\n    x = {}\n    for word in text.split():\n"
    "        x[word] = x.get(word, 0) + 1\n    return x\n",
    "def largest(values):\n    x = values[0]\n    for v in values[1:]:\n        if v > x:\n"
    "            x = v\n    return x\n",
    "def clamp(value, low, high):\n    x = value\n    if x < low:\n        x = low\n"
    "    if x > high:\n        x = high\n    return x\n",
    "def average(numbers):\n    x = sum(numbers)\n    if not numbers:\n        return 0\n"
    "    return x / len(numbers)\n",
    "def evens(numbers):\n    x = []\n    for n in numbers:\n        if n % 2 == 0:\n"
    "            x.append(n)\n    return x\n",
    "def initials(name):\n    x = ''\n    for part in name.split():\n        x += part[0]\n"
    "    return x.upper()\n",
    "def repeat(text, times):\n    x = ''\n    for _ in range(times):\n        x += text\n"
    "    return x\n",
    "def first_even(numbers):\n    x = None\n    for n in numbers:\n        if n % 2 == 0:\n"
    "            x = n\n            break\n    return x\n",
    "def squares(limit):\n    x = []\n    for i in range(limit):\n        x.append(i * i)\n"
    "    return x\n",
]
QUESTIONS = [
    "What are good habits for learning a new language?",
    "Why is the sky blue? Explain it to a child.",
    "Give me three ideas for a rainy Sunday afternoon.",
    "How do I start running if I have never run before?",
    "What should I pack for a weekend in the mountains?",
    "Write a short poem about the sea.",
    "How can I keep houseplants alive while I travel?",
    "What is a good way to plan a week of meals?",
    "How do bees make honey?",
    "What can I do to sleep better?",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "year": {"type": "integer"},
    },
    "required": ["name", "city", "year"],
    "additionalProperties": False,
}


def tasks() -> dict[str, list[dict[str, Any]]]:
    """Each task's requests: chat messages and sampling fields."""

    def user(text: str, **extra: Any) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": text}], **extra}

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    return {
        "summarize": [user(f"Summarize this text in two sentences.\n\n{t}") for t in TEXTS],
        "extract": [
            user(
                f"Read the note and give the person's name, city and birth year as JSON.\n\n"
                f"Note: {name} was born in {city} in {year} and still lives there.",
                response_format=fmt,
            )
            for name, city, year in RECORDS
        ],
        "rewrite": [
            user(f"Rewrite this paragraph in plain words, keeping every fact.\n\n{t}")
            for t in TEXTS
        ],
        "edit": [
            user(
                f"Rename the variable x to result in this function and show the whole "
                f"function.\n\n```python\n{f}```"
            )
            for f in FUNCTIONS
        ],
        "chat": [user(q) for q in QUESTIONS],
    }


def worker(route: str, threads: int, max_new_tokens: int, name: str, settings: tuple[str, ...],
           per_task: int) -> dict[str, Any]:  # fmt: skip
    """One round in this process: every request with every setting, in turn."""
    import edgeinfer

    draft = next((s for s in settings if s.startswith("draft:")), "off")  # opened at load
    model = edgeinfer.load(name, engine=ROUTES[route], threads=threads, context_length=1024,
                           speculative=draft)  # fmt: skip
    runs: list[dict[str, Any]] = []
    with model:
        warm = tasks()["summarize"][0]
        for setting in settings:
            model.chat(warm["messages"], max_new_tokens=16, temperature=0, speculative=setting)
        for task, requests in tasks().items():
            for i, request in enumerate(requests[:per_task]):
                extra = {k: v for k, v in request.items() if k != "messages"}
                mine = []
                for setting in settings:
                    r = model.chat(request["messages"], max_new_tokens=max_new_tokens,
                                   temperature=0, speculative=setting, **extra)  # fmt: skip
                    mine.append({
                        "task": task, "prompt": i, "setting": setting,
                        "token_ids": list(r.token_ids), "tokens": r.stats.completion_tokens,
                        "decode_tok_s": r.stats.decode_tokens_per_s,
                        "drafted": r.stats.draft_tokens, "accepted": r.stats.accepted_tokens,
                    })  # fmt: skip
                    if setting == "off":
                        mine[0]["text"] = r.text
                mine[0]["prompt_text"] = model.apply_chat_template(request["messages"])
                _margins(model, request, extra, max_new_tokens, mine)
                runs += mine
        info = {"route": model.info.get("route"), "backend": model.info.get("backend"),
                "pass_costs": _pass_costs(model)}  # fmt: skip
    return {"route": route, "info": info, "runs": runs}


def _pass_costs(model: Any) -> dict[str, Any]:
    """The model's measured passes over 1 + k tokens, in one-token steps (what drafting k
    tokens must beat: k kept drafts pay only where the pass costs less than k + 1 steps)."""
    costs = model._costs
    ratios = {str(k): round(costs.ratio(k), 3) for k in sorted(costs.pass_s)}
    return {"step_ms": round(costs.step_s * 1000, 3), "pass_over_step": ratios}


def _margins(model: Any, request: dict[str, Any], extra: dict[str, Any], n: int,
             runs: list[dict[str, Any]]) -> None:  # fmt: skip
    """Where a run's tokens part from plain decoding's: the position, and by how much the
    model prefers plain decoding's token there over the run's (nats, teacher-forced over
    plain decoding's own tokens in an untimed pass: ``Model.score``)."""
    plain = runs[0]["token_ids"]
    parted = [r for r in runs[1:] if r["token_ids"] != plain]
    if not parted:
        return
    ids = model.tokenize(runs[0]["prompt_text"], add_special=False)
    for r in parted:
        pairs = enumerate(zip(plain, r["token_ids"], strict=False))
        at = next((i for i, (a, b) in pairs if a != b), min(len(plain), len(r["token_ids"])))
        r["diverged_at"] = at
        if at < min(len(plain), len(r["token_ids"])):
            scored = model.score(ids + plain[:at], [plain[at]], rows=True)
            row = scored.rows[0]
            r["plain_margin"] = float(row[plain[at]] - row[r["token_ids"][at]])


def summarize(rounds: list[dict[str, Any]], settings: tuple[str, ...] = SETTINGS) -> dict[str, Any]:
    """Per route, task and setting: the median of per-request ratios to plain decoding."""
    table: dict[str, Any] = {}
    for route in sorted({r["route"] for r in rounds}):
        runs = [run for r in rounds if r["route"] == route for run in r["runs"]]
        plain = {(x["task"], x["prompt"], i): x for i, x in enumerate(_by_round(rounds, route))
                 if x["setting"] == "off"}  # fmt: skip
        table[route] = {}
        for task in tasks():
            for setting in settings[1:]:
                ratios, same, margins, drafted, accepted = [], [], [], 0, 0
                for key, base in plain.items():
                    if key[0] != task:
                        continue
                    mine = _partner(rounds, route, base, setting)
                    if base["decode_tok_s"] > 0 and mine["decode_tok_s"] > 0:
                        ratios.append(mine["decode_tok_s"] / base["decode_tok_s"])
                    same.append(mine["token_ids"] == base["token_ids"])
                    if "plain_margin" in mine:
                        margins.append(mine["plain_margin"])
                    drafted += mine["drafted"]
                    accepted += mine["accepted"]
                table[route][f"{task}/{setting}"] = {
                    "decode_ratio_median": statistics.median(ratios) if ratios else None,
                    "decode_ratio_min": min(ratios, default=None),
                    "decode_ratio_max": max(ratios, default=None),
                    "drafted": drafted,
                    "accepted": accepted,
                    "acceptance": accepted / drafted if drafted else None,
                    "identical_to_plain": sum(same) / len(same) if same else None,
                    # plain decoding's top-two margin (nats) where a reply parted from it
                    "divergence_margins": sorted(margins),
                    "requests": len(same),
                }
        table[route]["plain_decode_tok_s_median"] = statistics.median(
            x["decode_tok_s"] for x in runs if x["setting"] == "off" and x["decode_tok_s"] > 0
        )
    return table


def _by_round(rounds: list[dict[str, Any]], route: str) -> list[dict[str, Any]]:
    out = []
    for n, r in enumerate(rounds):
        if r["route"] == route:
            out += [{**x, "round": n} for x in r["runs"]]
    return out


def _partner(rounds: list[dict[str, Any]], route: str, base: dict[str, Any], setting: str):
    for x in _by_round(rounds, route):
        same = (x["round"], x["task"], x["prompt"]) == (base["round"], base["task"], base["prompt"])
        if same and x["setting"] == setting:
            return x
    raise LookupError(base)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--routes", default="onnx,gguf")
    p.add_argument("-o", "--out", type=Path, default=Path("benchmarks/results/speculative.json"))
    p.add_argument("--model", default="smollm2-135m-instruct", help="the target model")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help="speculative settings, plain decoding ('off') first; e.g. "
                   "off,lookup,draft:qwen2.5-coder-0.5b-instruct")  # fmt: skip
    p.add_argument("--per-task", type=int, default=10, help="requests per task (at most 10)")
    p.add_argument("--worker", choices=sorted(ROUTES), help=argparse.SUPPRESS)
    args = p.parse_args()
    settings = tuple(args.settings.split(","))
    if settings[0] != "off":
        p.error("--settings must start with off (plain decoding, the baseline)")
    if args.worker:
        out = worker(args.worker, args.threads, args.max_new_tokens, args.model, settings,
                     args.per_task)  # fmt: skip
        print(json.dumps(out))
        return
    run = conditions.start(args.threads, args.rounds)
    rounds = []
    for n in range(args.rounds):
        for route in args.routes.split(","):  # routes interleaved, one process per round
            argv = [sys.executable, __file__, "--worker", route, "--threads", str(args.threads),
                    "--max-new-tokens", str(args.max_new_tokens), "--model", args.model,
                    "--settings", args.settings, "--per-task", str(args.per_task)]  # fmt: skip
            done = subprocess.run(argv, capture_output=True, text=True, check=True)
            rounds.append(json.loads(done.stdout.splitlines()[-1]))
            print(f"round {n + 1}/{args.rounds} {route} done", file=sys.stderr)
    summary = summarize(rounds, settings)
    result = {"conditions": conditions.finish(run), "model": args.model, "settings": settings,
              "per_task": args.per_task, "summary": summary, "rounds": rounds}  # fmt: skip
    conditions.write(args.out, result)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
