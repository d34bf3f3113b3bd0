"""A device script: answer questions read line by line from stdin, one JSON line each.

Built only on edgeinfer's public API, for a Raspberry Pi or Jetson running headless:

    echo "What is the boiling point of water?" | python apps/device_chat.py
"""

from __future__ import annotations

import argparse
import json
import sys

import edgeinfer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    try:
        model = edgeinfer.load(args.model, threads=args.threads)
    except edgeinfer.EdgeInferError as exc:
        print(f"device_chat: {exc}", file=sys.stderr)
        return 1
    with model:
        for line in sys.stdin:
            question = line.strip()
            if not question:
                continue
            try:
                if model.chat_template is None:  # a base model: complete the text as it is
                    result = model.generate(
                        question, max_new_tokens=args.max_new_tokens, temperature=0
                    )
                else:
                    result = model.chat(
                        [{"role": "user", "content": question}],
                        max_new_tokens=args.max_new_tokens,
                        temperature=0,
                    )
            except edgeinfer.EdgeInferError as exc:
                print(json.dumps({"question": question, "error": str(exc)}), flush=True)
                continue
            record = {
                "question": question,
                "answer": result.text,
                "finish_reason": result.finish_reason,
                "decode_tokens_per_s": round(result.stats.decode_tokens_per_s, 1),
            }
            print(json.dumps(record, ensure_ascii=False), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
