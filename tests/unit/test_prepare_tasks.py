"""How the prepare job packs chunks into Ray tasks (issue 17, part 3), without Ray."""
from __future__ import annotations

import pickle

from minimind_ray.data.prepare import Chunk, _TokenizerOnce, plan_tasks
from minimind_ray.data.sources import SourceFile
from tests.unit.test_formats import tok  # noqa: F401  (a module fixture)


def _chunks(sizes):
    return [Chunk(i, SourceFile(f"/d/f{i}.jsonl", n, 0, "jsonl"), 0, n, n) for i, n in enumerate(sizes)]


def _indexes(tasks):
    return [[c.index for c in t] for t in tasks]


def test_small_files_share_a_task_and_every_chunk_is_in_exactly_one():
    chunks = _chunks([3 << 20] * 8)  # 8 files of 3 MiB on 2 CPUs: 4 tasks of 2 files
    tasks = plan_tasks(chunks, chunk_bytes=32 << 20, cpus=2)
    assert _indexes(tasks) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    many = _chunks([10_000] * 1000)  # 1,000 files of 10 KB: 4 tasks, not 1,000
    tasks = plan_tasks(many, chunk_bytes=32 << 20, cpus=2)
    assert len(tasks) == 4 and sorted(c.index for t in tasks for c in t) == list(range(1000))


def test_packing_respects_chunk_bytes_and_puts_the_largest_task_first():
    chunks = _chunks([1000, 5000, 200, 200, 200, 4000, 100])
    tasks = plan_tasks(chunks, chunk_bytes=1500, cpus=1)
    assert _indexes(tasks) == [[1], [5], [0], [2, 3, 4], [6]]  # neighbours only: 1,000 + 5,000 would pass 1,500
    assert all(sum(c.nbytes for c in t) <= 1500 for t in tasks if len(t) > 1)
    one_big = plan_tasks(_chunks([40 << 20] * 4), chunk_bytes=32 << 20, cpus=2)
    assert _indexes(one_big) == [[0], [1], [2], [3]]  # big chunks are never packed


def test_the_tokenizer_is_built_once_per_process(tok):
    # Ray hands each task its own unpickled copy of the carrier; the tokenizer inside is built once
    first, second = (pickle.loads(pickle.dumps(_TokenizerOnce(tok))) for _ in range(2))
    assert first.get() is second.get()
    assert first.get().encode("The sky is blue.") == tok.encode("The sky is blue.")
