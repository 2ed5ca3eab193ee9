"""cutoff_len as LLaMA-Factory applies it: turn by turn, each turn's prompt and response shortened in proportion.

A conversation longer than cutoff_len keeps its turns in order (with `mask_history`, the last turn first: it is
the one trained) while tokens remain. Each turn gets what is left, split between its prompt and its response:
- a response shorter than half of what is left is kept whole and the prompt takes the rest;
- else a prompt shorter than half is kept whole and the response takes the rest;
- else both are cut, the response to its share of the turn's tokens (rounded down), the prompt to the remainder.
Each part keeps its first tokens. So a long prompt is cut and its response still trained, where keeping the first
cutoff_len tokens would cut the response away. The eos appended after the last turn (the formats without an
end-of-turn marker) is always kept, its token counted first.
"""

from __future__ import annotations

import numpy as np


def turn_lengths(prompt: int, response: int, room: int) -> tuple[int, int]:
    """(prompt, response) tokens kept of one turn when `room` tokens are left."""
    if 2 * response < room:
        response_room = room
    elif 2 * prompt < room:
        response_room = room - prompt
    else:
        response_room = int(room * (response / (prompt + response)))
    kept_response = min(response, response_room)
    return min(prompt, max(room - kept_response, 0)), kept_response


def kept_positions(turns: list[tuple[int, int]], suffix: int, cutoff_len: int, last_turn_first: bool) -> np.ndarray:
    """The token positions a conversation keeps under cutoff_len, in order: `turns` are its (prompt, response)
    lengths, `suffix` the tokens after the last turn."""
    starts = np.concatenate([[0], np.cumsum([prompt + response for prompt, response in turns])]).astype(np.int64)
    spans: list[tuple[int, int]] = []
    used = suffix
    order = range(len(turns) - 1, -1, -1) if last_turn_first else range(len(turns))
    for turn in order:
        if used >= cutoff_len:
            break
        prompt, response = turns[turn]
        kept_prompt, kept_response = turn_lengths(prompt, response, cutoff_len - used)
        start = int(starts[turn])
        spans += [(start, start + kept_prompt), (start + prompt, start + prompt + kept_response)]
        used += kept_prompt + kept_response
    end = int(starts[-1])
    spans.append((end, end + suffix))
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in sorted(spans)])
