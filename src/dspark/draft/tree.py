"""Draft trees: several candidate drafts of one request verified in one forward.

Where lookups find several candidates (prompt lookup of a long repeat, of 3- and 2-grams, the datastore, of
1-grams; lookup_first.py), they are merged into a token tree, shared prefixes sharing nodes. The nodes are
numbered so that a parent comes before its children (`parents[k]`: the node before draft k, -1 for the request's
last committed token). The target verifies all nodes in one forward: row 0 of the request is its last token, row
k + 1 draft k, at cache positions num_cached + row; each row attends to the committed context and its own ancestors
only (the other rows before it are hidden: model.FlatBatch.hidden) and is rotated at num_cached + its depth, so a
row's target distribution is the one a chain of its ancestors would give. Greedy verification then walks down
from the root, each step to the child whose token is the argmax of the current row; the walk's rows are moved to
num_cached + 1, 2, ... (`KVCache.keep`). A chain is the tree whose parents are -1, 0, 1, ...

Only greedy steps verify trees: lossless sampling over several candidates needs more than rejection sampling of
one chain, and point-mass candidates under the argmax need nothing more than equality.

Why: where the first source's draft is rejected early, another source's candidate often continues correctly, so a
tree of every source's draft accepts more tokens a step than the first source's chain, for a few more rows in the
forward, which cost little at these widths (benchmarks/results/engine_speed.md: verify step time by tokens).
"""
from __future__ import annotations


def merge(candidates: list[list[int]], cap: int) -> tuple[list[int], list[int]]:
    """Candidates (first first) merged into a tree of at most `cap` nodes: (tokens, parents). A candidate that
    does not fit is cut; the first one is a chain 0, 1, 2, ..."""
    tokens: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for candidate in candidates:
        at = -1
        for token in candidate:
            node = node_of.get((at, token))
            if node is None:
                if len(tokens) >= cap:
                    break
                node = node_of[(at, token)] = len(tokens)
                tokens.append(token)
                parents.append(at)
            at = node
    return tokens, parents


def chain(n: int) -> list[int]:
    """The parents of a chain of n drafts."""
    return list(range(-1, n - 1))


def layout(parents: list[int]) -> tuple[list[int], list[int]]:
    """Per verified row of a request (row 0: its last token, row k + 1: draft k with parent parents[k]): its depth
    and the bit mask of the rows before it that it must not see (bit j: row - j; FlatBatch.hidden)."""
    depth, seen = [0], [1]  # seen: bit r set where row r is an ancestor (or the row itself)
    hidden = [0]
    for row, parent in enumerate(parents, 1):
        if not -1 <= parent < row - 1:
            raise ValueError(f"draft {row - 1}'s parent {parent} does not come before it")
        depth.append(depth[parent + 1] + 1)
        seen.append(seen[parent + 1] | 1 << row)
        hidden.append(sum(1 << (row - r) for r in range(row) if not seen[row] >> r & 1))
    return depth, hidden
