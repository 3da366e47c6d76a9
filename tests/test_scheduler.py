"""The forward's tile order (templates/include/flashgen/scheduler.cuh), run on the host: the header's
tile() is __host__ __device__, so nvcc compiles it into a small host program that prints the order.

Checked: every tile of every shape runs exactly once; causal tiles run longest first within each L2
section, the (batch, head) pairs of a section fastest, the last section of tail_heads pairs; a section
of all pairs is the plain longest-first order; core.section_heads keeps a section's K and V within
L2_SECTION_BYTES and L2_SECTION_KV_HEADS K/V heads, core.tail_heads merges the last two sections
where their K and V fit in L2_SECTION_BYTES."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flashgen.core import L2_SECTION_BYTES, L2_SECTION_KV_HEADS, section_heads, tail_heads, tail_section

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import run_host_program  # noqa: E402

PROGRAM = r"""
#include <cstdio>
#include "flashgen/scheduler.cuh"
int main() {
  int causal, m, h, b, sec, tail;
  while (std::scanf("%d %d %d %d %d %d", &causal, &m, &h, &b, &sec, &tail) == 6) {
    const int n = m * h * b, last = (h * b - tail) / sec;  // the last section's index (core.tail_section)
    for (int t = 0; t < n; ++t) {
      flashgen::WorkTile w = causal ? flashgen::TileScheduler<true>{m, h, b, n, sec, nullptr}.tile(t, last)
                                    : flashgen::TileScheduler<false>{m, h, b, n, sec, nullptr}.tile(t, last);
      std::printf("%d %d %d\n", w.m_block, w.head, w.batch);
    }
  }
}
"""

CASES = [  # causal, num_m_blocks, heads, batch, section_heads, tail_heads (the last section's pairs)
    (1, 4, 16, 32, 128, 128), (1, 4, 16, 32, 128, 256), (1, 4, 16, 32, 512, 512), (1, 4, 16, 32, 1, 1),
    (1, 4, 16, 32, 1, 2), (1, 7, 3, 5, 4, 3), (1, 7, 3, 5, 4, 7), (1, 7, 3, 5, 15, 15), (1, 1, 1, 1, 1, 1),
    (1, 128, 16, 1, 4, 4), (1, 128, 16, 1, 4, 8), (1, 9, 6, 2, 5, 2), (1, 9, 6, 2, 5, 7), (1, 4, 16, 16, 16, 32),
    (0, 4, 16, 32, 128, 128), (0, 7, 3, 5, 4, 3),
]


@pytest.fixture(scope="module")
def orders(tmp_path_factory):
    stdin = "".join(" ".join(map(str, c)) + "\n" for c in CASES)
    out = run_host_program(tmp_path_factory.mktemp("sched"), PROGRAM, stdin, "the scheduler test")
    rows = [tuple(map(int, line.split())) for line in out.splitlines()]
    res, at = {}, 0
    for c in CASES:
        n = c[1] * c[2] * c[3]
        res[c] = rows[at:at + n]
        at += n
    assert at == len(rows)
    return res


@pytest.mark.parametrize("case", CASES)
def test_every_tile_once(orders, case):
    _, m, h, b, _, _ = case
    order = orders[case]
    assert sorted(order) == sorted((i, j, k) for i in range(m) for j in range(h) for k in range(b))


@pytest.mark.parametrize("case", [c for c in CASES if c[0]])
def test_causal_sections_longest_first(orders, case):
    _, m, h, b, sec, tail = case
    order = orders[case]
    pairs = [w[2] * h + w[1] for w in order]
    assert (h * b - tail) % sec == 0
    starts = list(range(0, h * b - tail, sec)) + [h * b - tail]
    t = 0
    for start in starts:
        n_pairs = sec if start < h * b - tail else tail
        chunk = order[t:t + n_pairs * m]
        # this section's pairs only, all their m blocks, longest (largest m) first, pairs fastest
        assert sorted(set(pairs[t:t + n_pairs * m])) == list(range(start, start + n_pairs))
        assert [w[0] for w in chunk] == [m - 1 - i // n_pairs for i in range(n_pairs * m)]
        assert pairs[t:t + n_pairs] == list(range(start, start + n_pairs))
        t += n_pairs * m
    assert t == len(order)


def test_one_section_is_plain_longest_first(orders):
    _, m, h, b, sec, tail = case = (1, 4, 16, 32, 512, 512)
    assert sec == tail == h * b
    hb = h * b
    assert orders[case] == [(m - 1 - t // hb, (t % hb) % h, (t % hb) // h) for t in range(m * h * b)]


def test_noncausal_m_fastest(orders):
    case = (0, 7, 3, 5, 4, 3)
    assert orders[case] == [(t % 7, (t // 7) % 3, (t // 7) // 3) for t in range(7 * 3 * 5)]


def test_section_heads_fits_l2():
    # 16k tokens, hidden 2048, head_dim 128, bf16: K+V of one head is 8 MiB at seqlen 16384
    assert section_heads(1, 16, 16, 16384, 128, 128, 2) == L2_SECTION_BYTES // (16384 * 256 * 2) == 4
    assert section_heads(1, 16, 16, 10 ** 7, 256, 256, 2) == 1  # K/V larger than L2: one pair
    assert section_heads(2, 4, 4, 64, 64, 64, 2) == 8  # everything fits: one section of all pairs
    # GQA: 8 query heads share one K/V head, so 8x the query heads fit
    assert section_heads(32, 64, 8, 4096, 128, 128, 2) == 8 * section_heads(32, 64, 64, 4096, 128, 128, 2)
    assert section_heads(1, 16, 16, 16384, 128, 128, 1) == 8  # e4m3: one byte per element


def test_section_heads_caps_short_kv():
    # seqlen 512: K+V of one head is 256 KiB, so 128 heads would fit in L2_SECTION_BYTES; the cap keeps
    # a section to L2_SECTION_KV_HEADS K/V heads (their query blocks then run close enough in time to
    # share the K/V in L2), times the query heads of a group with GQA
    assert L2_SECTION_BYTES // (512 * 256 * 2) == 128
    assert section_heads(32, 16, 16, 512, 128, 128, 2) == L2_SECTION_KV_HEADS == 16
    assert section_heads(32, 16, 16, 512, 128, 128, 1) == 16
    assert section_heads(32, 32, 4, 512, 128, 128, 2) == 8 * L2_SECTION_KV_HEADS
    assert section_heads(1, 8, 8, 512, 128, 128, 2) == 8  # fewer pairs than the cap


def test_tail_heads_merges_the_last_two_sections_where_they_fit():
    # FA3's grid at seqlen 512, head_dim 256 (32 x 8 pairs): 16 sections of 16 heads; the last two run as one
    # (32 K/V heads of 512 KiB: 16 MiB), which balances the last wave (scripts/schedule_model.py)
    assert section_heads(32, 8, 8, 512, 256, 256, 2) == 16 and tail_heads(32, 8, 8, 512, 256, 256, 2) == 32
    # a short remainder joins the section before it: 35 pairs in sections of 16 -> 16, then 3 + 16
    assert section_heads(5, 7, 7, 512, 128, 128, 2) == 16 and tail_heads(5, 7, 7, 512, 128, 128, 2) == 19
    # the merged K/V would not fit in L2_SECTION_BYTES: the remainder alone (4 heads of 8 MiB at 16k, hd128)
    assert section_heads(1, 16, 16, 16384, 128, 128, 2) == 4 and tail_heads(1, 16, 16, 16384, 128, 128, 2) == 4
    assert tail_heads(1, 16, 16, 10 ** 7, 256, 256, 2) == 1  # K/V larger than L2: one pair
    assert tail_heads(2, 4, 4, 64, 64, 64, 2) == 8  # one section of all pairs
    assert tail_heads(1, 24, 24, 512, 128, 128, 2) == 24  # two sections (16 + 8): one
    # GQA: the bytes count K/V heads (8 query heads share one), as section_heads does
    assert section_heads(32, 64, 8, 4096, 128, 128, 2) == 8 * 16
    assert tail_heads(32, 64, 8, 4096, 128, 128, 2) == 8 * 16  # 32 K/V heads of 2 MiB: 64 MiB, too many
    assert tail_heads(32, 64, 8, 1024, 128, 128, 2) == 2 * 8 * 16  # 32 K/V heads of 512 KiB: 16 MiB
    for args in [(32, 8, 8, 512, 256, 256, 2), (5, 7, 7, 512, 128, 128, 2), (3, 40, 5, 8192, 64, 64, 1),
                 (7, 3, 1, 300, 96, 96, 2), (1, 1, 1, 1, 64, 64, 2)]:
        pairs, sec, tail = args[0] * args[1], section_heads(*args), tail_heads(*args)
        assert 1 <= tail <= pairs and (pairs - tail) % sec == 0 and tail <= 2 * sec
        assert tail_section(*args) == (pairs - tail) // sec


def test_tail_sections_one_is_the_plain_remainder(monkeypatch):
    import flashgen.core as core

    monkeypatch.setattr(core, "CAUSAL_TAIL_SECTIONS", 1)
    assert tail_heads(32, 8, 8, 512, 256, 256, 2) == 16 and tail_heads(5, 7, 7, 512, 128, 128, 2) == 3
    monkeypatch.setattr(core, "CAUSAL_TAIL_SECTIONS", 4)  # up to four sections, while their K/V fit
    assert tail_heads(32, 8, 8, 512, 256, 256, 2) == 64  # 64 K/V heads of 512 KiB: 32 MiB
    assert tail_heads(32, 8, 8, 1024, 256, 256, 2) == 32  # 1 MiB heads: three sections would be 48 MiB


def test_tail_sections_from_the_environment():
    import os
    import subprocess
    import sys

    code = "import flashgen.core as c; print(c.CAUSAL_TAIL_SECTIONS, c.tail_heads(32, 8, 8, 512, 256, 256, 2))"
    for env, want in (("1", "1 16"), ("2", "2 32"), (None, "2 32")):
        e = {k: v for k, v in os.environ.items() if k != "FLASHGEN_CAUSAL_TAIL_SECTIONS"}
        if env is not None:
            e["FLASHGEN_CAUSAL_TAIL_SECTIONS"] = env
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True).stdout
        assert out.split() == want.split()
    for bad in ("two", "0"):  # not an integer >= 1: an error naming the variable, at import
        e = {**os.environ, "FLASHGEN_CAUSAL_TAIL_SECTIONS": bad}
        r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True)
        assert r.returncode != 0 and "FLASHGEN_CAUSAL_TAIL_SECTIONS must be an integer >= 1" in r.stderr, r.stderr
