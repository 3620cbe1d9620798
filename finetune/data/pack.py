"""Packing: several samples per row of at most max_length tokens, each attending only to itself (its positions
restart at 0). First fit in a seeded order, in n log n; the token cache packs the same rows from its Arrow
columns (finetune.data.cache.pack_split), a stream packs each run of rows (finetune.rank.stream).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from finetune.data.tokenize import Example


def first_fit(lengths: list[int], max_length: int, seed: int | Sequence[int]) -> list[list[int]]:
    """Which samples (by index) share each packed row of at most `max_length` tokens: first fit, in a
    seeded order (what `pack` packs; the planner reads packed lengths from it without tokens).

    Each sample goes to the first row with room for it, found in O(log n) by descending a max-tree of
    the rows' free room (rows not opened yet are empty, so "no open row fits" lands on the next new one):
    n log n in all, a million samples in seconds, the same rows the plain scan gives."""
    order = np.random.default_rng(seed).permutation(len(lengths)).tolist()
    if lengths and max(lengths) > max_length:
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit a packed row of {max_length}")
    cap = 1
    while cap < len(lengths):
        cap *= 2
    room = [max_length] * (2 * cap)  # room[cap + r]: row r's free tokens; room[k]: the most under node k
    rows: list[list[int]] = []
    for i in order:
        n = lengths[i]
        node = 1
        while node < cap:  # the leftmost row with room >= n
            node = 2 * node if room[2 * node] >= n else 2 * node + 1
        r = node - cap
        if r == len(rows):
            rows.append([])
        rows[r].append(i)
        room[node] -= n
        node //= 2
        while node:  # refresh the maxima above it, up to the first one that does not change
            most = max(room[2 * node], room[2 * node + 1])
            if room[node] == most:
                break
            room[node] = most
            node //= 2
    return rows


def pack(examples: list[Example], max_length: int, seed: int | Sequence[int]) -> list[Example]:
    """Several samples per row of at most `max_length` tokens (first fit, in a seeded order).

    Each sample keeps its own labels, positions and images (in order: a vision-language model's rows); nothing crosses
    sample boundaries.
    """
    rows = [[examples[i] for i in row] for row in first_fit([len(e.input_ids) for e in examples], max_length, seed)]
    return [
        Example(
            input_ids=[t for e in row for t in e.input_ids],
            labels=[t for e in row for t in e.labels],
            prompt_len=0,
            reference="",
            position_ids=[p for e in row for p in range(len(e.input_ids))],
            images=tuple(image for e in row for image in e.images),
        )
        for row in rows
    ]
