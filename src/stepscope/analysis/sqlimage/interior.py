"""Interior pages above the leaves of table and index B-trees (one level at a time), and a
single B-tree page laid out in Python."""

from __future__ import annotations

import struct

from .records import even_split, varint_bytes
from .schema import INTERIOR_HDR, LEAF_HDR, PAGE


def interior_pages(children: list[int], keys: list[int], first_page: int) -> tuple[list, list]:
    """One level of interior pages over ``children``; returns (pages, [(page_no, max_key)])."""
    per = (PAGE - INTERIOR_HDR) // (2 + 4 + 9)
    # spread the children evenly: a last page with a single child would hold no cell at all,
    # which SQLite reads as a malformed database
    n_pages = -(-len(children) // per)
    sizes = even_split(len(children), n_pages).tolist()
    bounds = [sum(sizes[:j]) for j in range(n_pages + 1)]
    pages, up = [], []
    for i, j in zip(bounds[:-1], bounds[1:], strict=True):
        ch, ks = children[i:j], keys[i:j]
        cells = [struct.pack(">I", c) + varint_bytes(k)
                 for c, k in zip(ch[:-1], ks[:-1], strict=True)]
        pages.append(btree_page(5, cells, right=ch[-1]))
        up.append((first_page + len(pages) - 1, ks[-1]))
    return pages, up


def btree_page(kind: int, cells: list[bytes], right: int | None = None, offset: int = 0) -> bytes:
    """A B-tree page (``offset``: 100 for page 1, after the database header)."""
    hdr_len = INTERIOR_HDR if right is not None else LEAF_HDR
    page = bytearray(PAGE)
    end = PAGE
    ptrs = []
    for c in cells:
        end -= len(c)
        page[end : end + len(c)] = c
        ptrs.append(end)
    if offset + hdr_len + 2 * len(cells) > end:
        raise ValueError("page overflow")
    h = offset
    page[h] = kind
    struct.pack_into(">HHHB", page, h + 1, 0, len(cells), end % PAGE, 0)
    if right is not None:
        struct.pack_into(">I", page, h + 8, right)
    for i, p in enumerate(ptrs):
        struct.pack_into(">H", page, h + hdr_len + 2 * i, p)
    return bytes(page)


def index_interior(children: list[int], divs: list[bytes], first_page: int) -> tuple:
    """One level of interior pages of an index B-tree: (pages, their numbers, entries that go
    up). ``divs[i]`` is the entry between ``children[i]`` and ``children[i + 1]``."""
    per = (PAGE - INTERIOR_HDR) // (2 + 4 + 9 + max(len(d) for d in divs)) + 1  # children
    n_pages = -(-len(children) // per)
    sizes = even_split(len(children), n_pages).tolist()
    pages, up_divs, i = [], [], 0
    for j, sz in enumerate(sizes):
        ch, dv = children[i : i + sz], divs[i : i + sz - 1]
        cells = [struct.pack(">I", c) + varint_bytes(len(d)) + d for c, d in zip(ch[:-1], dv,
                                                                              strict=True)]
        pages.append(btree_page(2, cells, right=ch[-1]))
        if j < n_pages - 1:
            up_divs.append(divs[i + sz - 1])
        i += sz
    return pages, list(range(first_page, first_page + n_pages)), up_divs
