"""Demonstrations for the trainer's behaviour-cloning anchor (InstructGPT's PPO-ptx, on transcripts).

RL on a narrow task mix can unlearn what it never samples: in the default run, RL on two-step
tasks sometimes broke held-out one-step tasks the mid-trained model solved (docs/run.md). With
`demo_coef` > 0 the trainer adds, to every optimizer step, the mean next-token loss of a few
demonstration transcripts on the tokens the assistant wrote, so the policy keeps fitting them.

    demos.jsonl      one {"messages": [...]} per line (OpenAI-shaped chat transcripts)

`whetstone run` writes its mid-training demonstrations there. The rows of step s, part p are
drawn by a seed made of (s, p), so a replayed step (trainer resume) trains on the same rows.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from whetstone.config import expand_path
from whetstone.errors import WhetstoneError
from whetstone.rl.batch import Batch, collate
from whetstone.rl.samples import NOT_GENERATED, Sample
from whetstone.tokenizer import Message, Tokenizer, encode_chat
from whetstone.utils.atomic import atomic_write_text
from whetstone.utils.jsonl import read_json_lines


def write_demos(path: str | Path, transcripts: Iterable[list[Message]]) -> int:
    """Write the transcripts as demos.jsonl (atomically); returns how many."""
    lines = [json.dumps({"messages": messages}, sort_keys=True) for messages in transcripts]
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return len(lines)


def load_demos(path: str | Path, tokenizer: Tokenizer, max_positions: int = 0) -> list[Sample]:
    """The transcripts of `path` as samples that train on the assistant's tokens. Transcripts
    longer than `max_positions` (0 = any length) are skipped; a bad line is an error naming it."""
    path = expand_path(path)
    try:
        lines = list(read_json_lines(path))
    except OSError as err:  # missing, a folder, unreadable, under a file, a link loop
        raise WhetstoneError(
            f"demonstrations file {path} cannot be read ({err}): point demos_path at a readable JSONL file"
        ) from None
    demos = []
    for line in lines:
        number, where = line.number, f"{path}, line {line.number}"
        try:
            if line.problem:
                raise ValueError(line.problem)
            messages = line.value.get("messages") if isinstance(line.value, dict) else None
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise TypeError("'messages' is not a list of objects")
            encoded = encode_chat(tokenizer, messages)
        except (ValueError, TypeError, WhetstoneError) as err:
            raise WhetstoneError(f'{where}: not a demonstration ({{"messages": [...]}}): {err}') from None
        positions = len(encoded.ids) - 1
        if not any(encoded.assistant_mask[1:]):
            raise WhetstoneError(f"{where}: the transcript has no assistant tokens to train on")
        if max_positions and positions > max_positions:
            continue
        demos.append(
            Sample(
                encoded.ids,
                [int(m) for m in encoded.assistant_mask[1:]],
                [0.0] * positions,
                [NOT_GENERATED] * positions,
                routes=None,
                reward=0.0,
                task_id=f"demo:{number}",
            )
        )
    if not demos:
        raise WhetstoneError(
            f"demonstrations file {path} has no transcript to train on"
            + (f" of at most {max_positions} positions" if max_positions else "")
        )
    return demos


def demo_rows(demos: list[Sample], rows: int, seed: int, pad_id: int = 0) -> Batch:
    """`rows` demonstrations drawn without replacement (or all of them, if fewer) by `seed`."""
    picked = random.Random(seed).sample(range(len(demos)), min(rows, len(demos)))
    return collate([demos[i] for i in picked], pad_id=pad_id)
