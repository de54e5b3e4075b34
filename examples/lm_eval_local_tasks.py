"""Three lm-evaluation-harness tasks over local JSONL files cut from TinyStories, for offline runs.

    python examples/lm_eval_local_tasks.py /tmp/ts_tasks          # writes the files, prints a command
    python -m pagedgen.integrations.lm_eval --model pagedgen \\
        --model_args pretrained=../shared/models/stories260K,dtype=float32,max_length=128 \\
        --include_path /tmp/ts_tasks --tasks ts_mc ts_gen ts_roll

The tasks (names prefixed by ``--prefix``, default "ts"):
  ts_mc    multiple_choice, metric acc: the first two sentences of a story; which of four sentences
           (its real third one, or the third sentence of three other stories) comes next.
  ts_gen   generate_until, metric exact_match: continue the first two sentences until "." or a
           newline, at most --gen-tokens tokens, greedy.
  ts_roll  loglikelihood_rolling, metric word_perplexity: whole stories (--stories-per-doc joined),
           longer than a small max_length, so lm_eval scores them in rolling windows.

Each task is a YAML file that loads its JSONL file with the datasets library's local ``json`` builder
(``dataset_path: json``, ``dataset_kwargs.data_files``, ``test_split: test``): nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data",
                            "tinystories_valid_first1000", "tinystories_valid_first1000.jsonl")


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text.replace("\n", " ")) if s.strip()]


def _yaml(name: str, data_file: str, body: str) -> str:
    return (
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(os.path.abspath(data_file))}\n"
        "test_split: test\n" + body
    )


def write_tasks(out_dir: str, data: str = DEFAULT_DATA, *, num_docs: int = 10, num_roll_docs: int = 4,
                stories_per_doc: int = 1, gen_tokens: int = 16, prefix: str = "ts", seed: int = 0) -> list[str]:
    """Write ``{prefix}_mc``, ``{prefix}_gen`` and ``{prefix}_roll`` (YAML + JSONL) into ``out_dir``.

    Args:
        out_dir: folder for the files (created); give it to lm_eval as ``include_path``.
        data: TinyStories JSONL (``{"text": ...}`` per line).
        num_docs: documents of the multiple-choice and generation tasks each.
        num_roll_docs: documents of the rolling-perplexity task.
        stories_per_doc: stories joined into one rolling-perplexity document.
        gen_tokens: ``max_gen_toks`` of the generation task.
        prefix: task name prefix.
        seed: shuffles the choices.

    Returns:
        the task names.

    Raises:
        ValueError: the data file holds too few stories with three sentences for ``num_docs``.
    """
    with open(data, encoding="utf-8") as f:
        stories = [json.loads(line)["text"] for line in f if line.strip()]
    usable = [s for s in (_sentences(t) for t in stories) if len(s) >= 3]
    if len(usable) < num_docs + 3:
        raise ValueError(f"{data} has {len(usable)} stories of 3+ sentences; {num_docs + 3} needed for num_docs={num_docs}")
    rng = random.Random(seed)
    mc, gen = [], []
    for i, s in enumerate(usable[:num_docs]):
        context, gold = " ".join(s[:2]), s[2]
        choices = [gold] + [usable[(i + k) % len(usable)][2] for k in (1, 2, 3)]
        rng.shuffle(choices)
        mc.append({"context": context, "choices": choices, "gold": choices.index(gold)})
        gen.append({"prompt": context, "target": " " + gold})
    roll = [{"text": " ".join(stories[i * stories_per_doc:(i + 1) * stories_per_doc])} for i in range(num_roll_docs)]

    os.makedirs(out_dir, exist_ok=True)
    bodies = {
        "mc": (mc, 'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: choices\n'
                   "doc_to_target: gold\nmetric_list:\n  - metric: acc\n"),
        "gen": (gen, 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
                     'target_delimiter: ""\ngeneration_kwargs:\n  until: [".", "\\n"]\n'
                     f"  max_gen_toks: {gen_tokens}\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n"),
        "roll": (roll, 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                       "metric_list:\n  - metric: word_perplexity\n"),
    }
    names = []
    for kind, (rows, body) in bodies.items():
        name = f"{prefix}_{kind}"
        data_file = os.path.join(out_dir, f"{name}.jsonl")
        with open(data_file, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        with open(os.path.join(out_dir, f"{name}.yaml"), "w", encoding="utf-8") as f:
            f.write(_yaml(name, data_file, body))
        names.append(name)
    return names


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="folder for the task files (lm_eval's --include_path)")
    p.add_argument("--data", default=DEFAULT_DATA, help="TinyStories JSONL (default: ../shared/data/...)")
    p.add_argument("--num-docs", type=int, default=10, help="documents of the multiple-choice and generation tasks")
    p.add_argument("--num-roll-docs", type=int, default=4, help="documents of the rolling-perplexity task")
    p.add_argument("--stories-per-doc", type=int, default=1, help="stories per rolling-perplexity document")
    p.add_argument("--gen-tokens", type=int, default=16, help="max_gen_toks of the generation task")
    p.add_argument("--prefix", default="ts", help="task name prefix")
    args = p.parse_args(argv)
    names = write_tasks(args.out_dir, args.data, num_docs=args.num_docs, num_roll_docs=args.num_roll_docs,
                        stories_per_doc=args.stories_per_doc, gen_tokens=args.gen_tokens, prefix=args.prefix)
    print(f"wrote {', '.join(names)} to {args.out_dir}; run them with:")
    print("  python -m pagedgen.integrations.lm_eval --model pagedgen \\\n"
          "      --model_args pretrained=../shared/models/stories260K,dtype=float32,max_length=128 \\\n"
          f"      --include_path {args.out_dir} --tasks {' '.join(names)}")


if __name__ == "__main__":
    main()
