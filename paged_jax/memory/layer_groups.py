"""Layer groups: how a model's layers share the paged KV cache (one block table per group).

A model declares each layer's attention kind by its sliding window (``None``: full attention;
``ModelConfig.attention_spec(i).sliding_window``). Layers of one kind need the same keys, so
they can share block tables; a windowed kind needs only the blocks inside its window, so it can
free the rest, which a full-attention kind cannot. A model with one kind keeps one group of all
its layers, laid out as always: one KV array pair per layer, one block table per sequence.

A model with several kinds (Gemma 2 and 3: windowed layers between global ones) gets one
group per ``P`` layers of a kind, where ``P`` is the greatest common divisor of the kinds'
layer counts, and every group's blocks come from **one pool of same-sized pages**: the KV
cache is ``P`` array pairs of ``[num_pages, block_size, heads, head_dim]``, a page (block id)
holds ``block_size`` tokens of ``P`` layers, and layer ``l`` reads and writes array
``layer_slot[l]`` through its group's table ``layer_group[l]``. This is vLLM's hybrid KV
cache manager's layout, chosen over one pool per kind with a fixed split of the bytes because
the right split depends on the workload (short contexts need as many windowed blocks as full
ones; 8k contexts need a sixth as many): with one pool of pages, every group takes what it
holds and no byte is set aside for a kind that does not need it. Copies and swaps move pages
by id across all ``P`` arrays, so the cache operations are the same as for one group.

Gemma 3 (five windowed layers to one global): the 1B model's 26 layers are 22 windowed and 4
global, so ``P = 2`` and 13 groups; the tiny test model's 6 layers make 6 groups of one layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class KVLayout:
    """Which group and which KV array each layer uses, and each group's window."""

    windows: tuple[Optional[int], ...]  # per group: the sliding window its blocks are freed by (None: keep all)
    layer_group: tuple[int, ...]  # per layer: its group (the block table it reads)
    layer_slot: tuple[int, ...]  # per layer: the KV array pair it reads and writes

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """KV array pairs in the cache: layers per page."""
        return max(self.layer_slot) + 1

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)


def kv_layout(layer_windows: Sequence[Optional[int]], groups: bool = True) -> KVLayout:
    """The layout for layers with these sliding windows (``None``: full attention). ``groups``
    False keeps one group of every layer (no block freed unless every layer has the one window):
    the one-pool layout, how a hybrid model ran before layer groups."""
    n = len(layer_windows)
    kinds = list(dict.fromkeys(layer_windows))  # in order of first appearance
    if len(kinds) == 1 or not groups:
        window = kinds[0] if len(kinds) == 1 and groups else None
        return KVLayout((window,), (0,) * n, tuple(range(n)))
    members = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
    per_page = math.gcd(*(len(m) for m in members.values()))
    windows: list[Optional[int]] = []
    layer_group, layer_slot = [0] * n, [0] * n
    for kind in kinds:
        for j, layer in enumerate(members[kind]):
            if j % per_page == 0:
                windows.append(kind)
            layer_group[layer], layer_slot[layer] = len(windows) - 1, j % per_page
    return KVLayout(tuple(windows), tuple(layer_group), tuple(layer_slot))
