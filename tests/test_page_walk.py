"""The paged K / V walk of the forward's producer (templates/include/flashgen/mask.cuh PageWalk), run on the host:
the struct is __host__ __device__, so nvcc compiles it into a small host program that prints the walk.

Checked against the definition the kernel used before the walk (fwd.cu.j2's paged branch until session 18): box i
of a block whose first key is key0 reads page entry min(key, last) // page_size at row key % page_size, key =
key0 + i * box; and a box never crosses a page where the block starts on a multiple of block_n (box =
gcd(page_size, block_n), core._varlen_params)."""
from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import run_host_program  # noqa: E402

BOXES = 24  # boxes walked per case (more than one block's: the walk is not reset per block)

PROGRAM = r"""
#include <cstdio>
#include "flashgen/mask.cuh"
int main() {
  int key0, last, box, page;
  while (std::scanf("%d %d %d %d", &key0, &last, &box, &page) == 4) {
    flashgen::PageWalk w{key0, last, box, page};
    for (int i = 0; i < %BOXES%; ++i, w.next()) std::printf("%d %d ", w.clamped(), w.row);
    std::printf("\n");
  }
}
""".replace("%BOXES%", str(BOXES))


def cases():
    rng = random.Random(0)
    out = []
    for block_n in (64, 80, 112, 128, 176, 192):
        for page in (8, 16, 24, 48, 64, 128, 256, 512):
            box = math.gcd(page, block_n)
            for _ in range(6):
                n = rng.randrange(0, 40)
                seqlen_k = rng.randrange(1, 40 * block_n)
                out.append((n * block_n, max(seqlen_k - 1, 0), box, page))
            out.append((0, 0, box, page))  # one key (and seqlen_k 0: last 0 too)
            out.append((rng.randrange(0, 5000), rng.randrange(0, 5000), box, page))  # any start
    return out


@pytest.fixture(scope="module")
def walks(tmp_path_factory):
    cs = cases()
    stdin = "".join(" ".join(map(str, c)) + "\n" for c in cs)
    out = run_host_program(tmp_path_factory.mktemp("pagewalk"), PROGRAM, stdin, "the page walk test")
    rows = [list(map(int, line.split())) for line in out.splitlines()]
    assert len(rows) == len(cs)
    return list(zip(cs, rows))


def test_walk_matches_the_division_form(walks):
    for (key0, last, box, page), row in walks:
        got = [(row[2 * i], row[2 * i + 1]) for i in range(BOXES)]
        want = [(min(key0 + i * box, last) // page, (key0 + i * box) % page) for i in range(BOXES)]
        assert got == want, (key0, last, box, page)


def test_boxes_stay_inside_their_page(walks):
    for (key0, last, box, page), row in walks:
        if key0 % box:
            continue  # (an arbitrary start: checked against the division form only)
        assert all(row[2 * i + 1] + box <= page for i in range(BOXES)), (key0, box, page)
