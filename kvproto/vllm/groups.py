"""KV cache groups (vLLM's hybrid allocator) for the kvproto connector: which groups it
accepts, how P's per-group block lists travel in the transfer params, and which of D's
blocks each READ fills (spec/VLLM.md §7).

No vLLM import at module level: the connector passes vLLM's objects in, ``sched`` and the
tests use the plain functions.

Facts of vLLM 0.32 this relies on (read in its sources, checked by the end-to-end tests):

* All default groups allocate from ONE block pool (other roles, e.g. HiSparse host
  groups, are refused), and a block id belongs to one group at a time;
  the KV tensors of the layers of different groups alias the same memory (one tensor
  per layer position, shared by one layer of each group). So one block id names the same
  bytes in every registered tensor, a READ of block b copies whatever group owns b, and
  one generation stamp per block id covers every group.
* A request's block list of group g has one entry per ``block_size`` tokens, in token
  order. Entries a window no longer reaches (sliding window, chunked local attention)
  are vLLM's null block (id 0), and only at the front: P's lists are trimmed that way
  before ``request_finished_all_groups``; D's lists have nulls where D will not attend,
  local prefix-cache hits (hashed blocks), and new blocks for the tokens to load.
* With several groups vLLM refuses block-level load errors (``invalid_block_ids``); a
  failed load is reported by request (``failed_recving``) and recomputed or failed whole.

The transfer params carry, per group, ``[skip, count]``: the group's list on P is
``skip`` nulls followed by ``count`` real blocks, and the real blocks of all groups are
concatenated, in group order, in the params' ``blocks`` (one generation each). D reads
block position i of group g into its own block at position i exactly when that block is
new (neither null nor a local hit); if P's entry there is a null, D needs KV that P no
longer has, and the load is refused (it recomputes or fails per
``kv_load_failure_policy``): D never computes on a block it neither read nor computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvproto.errors import UsageError

NULL_BLOCK = 0  # vLLM's null block id (the block pool's first block, never allocated)
MAX_GROUPS = 64  # KV cache groups a config or a transfer params may name

# D's view of one of its blocks: what a READ may do with it.
NEW = 0  # allocated for this load: the READ fills it
HIT = 1  # a local prefix-cache hit: D already holds its KV
NULL = 2  # out of the window: D will not attend it

# The spec classes kvproto transfers (attention; their block lists are positional).
ATTENTION_SPECS = ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec")


class GroupsError(UsageError, ValueError):
    """A KV cache configuration the connector refuses at start-up (one line)."""


@dataclass(frozen=True)
class GroupInfo:
    """One KV cache group as the connector sees it."""

    kind: str  # the vLLM spec class name
    block_size: int
    window: int | None  # sliding window or attention chunk, tokens; None: full attention
    layers: int


def _spec_kind(spec: Any) -> str | None:
    """The accepted spec class ``spec`` is an instance of (by MRO name), or None."""
    names = [c.__name__ for c in type(spec).__mro__]
    for n in names:
        if n in ATTENTION_SPECS:
            return n
    return None


def describe(kv_cache_config: Any) -> list[GroupInfo]:
    """The groups of ``kv_cache_config``; raise GroupsError (one line) for a group the
    connector cannot transfer: state-space (Mamba) and other non-attention groups, and
    groups that vLLM excludes from KV transfer."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return []
    if len(groups) > MAX_GROUPS:
        raise GroupsError(f"kvproto: {len(groups)} KV cache groups (at most {MAX_GROUPS})")
    out: list[GroupInfo] = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        kind = _spec_kind(spec)
        if kind is None:
            raise GroupsError(
                f"kvproto: KV cache group {i} is {type(spec).__name__} (layers "
                f"{list(g.layer_names)[:2]}...); KVProtoConnector transfers attention "
                f"groups only ({', '.join(ATTENTION_SPECS)}), not state-space or other "
                "layers: use a connector that supports them, or an attention-only model")
        role = getattr(g, "role", "default")
        if str(getattr(role, "value", role)) != "default" or getattr(g, "host_resident", False):
            raise GroupsError(f"kvproto: KV cache group {i} ({kind}) has role "
                              f"{getattr(role, 'value', role)!s} outside vLLM's one device "
                              "block pool; KVProtoConnector transfers default groups only")
        if getattr(g, "enable_kv_transfer", True) is False:
            raise GroupsError(f"kvproto: KV cache group {i} ({kind}) is excluded from KV "
                              "transfer; KVProtoConnector transfers every group")
        window = getattr(spec, "sliding_window", None) or \
            getattr(spec, "attention_chunk_size", None)
        out.append(GroupInfo(kind, int(spec.block_size), int(window) if window else None,
                             len(g.layer_names)))
    return out


def split_p_blocks(block_ids: Sequence[Sequence[int]]
                   ) -> tuple[list[int], list[list[int]]] | str:
    """P: a finished request's per-group block lists -> (the real blocks of all groups in
    group order, ``[[skip, count], ...]``), or a one-line reason when a list is not
    ``skip`` nulls followed by real blocks (a null after a real block, a block listed
    twice): the request is then not handed to D."""
    if not 1 <= len(block_ids) <= MAX_GROUPS:
        return f"{len(block_ids)} KV cache groups"
    flat: list[int] = []
    layout: list[list[int]] = []
    for g, blocks in enumerate(block_ids):
        skip = 0
        while skip < len(blocks) and blocks[skip] == NULL_BLOCK:
            skip += 1
        real = list(blocks[skip:])
        if NULL_BLOCK in real:
            return f"group {g}: a null block after a real one"
        flat.extend(real)
        layout.append([skip, len(real)])
    if len(set(flat)) != len(flat):
        return "a block listed twice"
    return flat, layout


def d_view(kv_blocks: Any) -> list[list[tuple[int, int]]]:
    """D: vLLM's ``KVCacheBlocks`` (one list of KVCacheBlock per group) as plain
    ``(block id, NEW | HIT | NULL)`` lists."""
    out: list[list[tuple[int, int]]] = []
    for group in getattr(kv_blocks, "blocks", None) or ():
        out.append([(int(b.block_id), NULL if b.is_null else
                     HIT if b.block_hash is not None else NEW) for b in group])
    return out


def plan_load(layout: Sequence[Sequence[int]], d_groups: Sequence[Sequence[tuple[int, int]]]
              ) -> tuple[list[int], list[int]] | str:
    """D: which local blocks a READ fills and from which of the params' blocks.

    ``layout`` is P's ``[[skip, count], ...]``; ``d_groups`` is :func:`d_view` of D's
    blocks. Position i of group g on D is read from position i of group g on P when D's
    block there is NEW; positions past P's list (tokens P did not compute) are D's own.
    Returns (local blocks, indices into the params' ``blocks``), or a one-line reason
    when D needs a position P holds no block for, or the group counts differ."""
    if len(layout) != len(d_groups):
        return f"P has {len(layout)} KV cache groups, D {len(d_groups)}"
    local: list[int] = []
    index: list[int] = []
    off = 0
    for g, ((skip, count), dg) in enumerate(zip(layout, d_groups, strict=True)):
        if len(dg) < skip + count:
            return (f"group {g}: D has {len(dg)} block positions, P's KV covers "
                    f"{skip + count}")
        for i, (bid, kind) in enumerate(dg):
            if kind != NEW or i >= skip + count:
                continue
            if i < skip:
                return (f"group {g}: D needs block position {i}, P kept positions "
                        f"{skip}..{skip + count - 1} only")
            local.append(bid)
            index.append(off + i - skip)
        off += count
    return local, index


def single_layout(num_blocks: int) -> list[list[int]]:
    """The layout of params without a ``groups`` field: one group, no nulls."""
    return [[0, num_blocks]]
