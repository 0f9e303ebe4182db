"""Bounded-memory storage for the items of one transaction.

A transaction is emitted only at its COMMIT, so its changes must be held until then. An
``ItemSpool`` keeps up to ``memory_items`` items in memory and appends the rest to a file
(JSON lines, lossless), so a transaction of any size fits in bounded memory. The same format
persists prepared transactions between batches (:meth:`ItemSpool.save` / :meth:`ItemSpool.load`).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from airflow_provider_pgdecode.decoding.events import TransactionItem, item_from_json, item_to_json
from airflow_provider_pgdecode.errors import staging_io

DEFAULT_MEMORY_ITEMS = 20_000


class ItemSpool:
    """An append-only sequence of transaction items that spills to disk past a size.

    :param memory_items: how many items stay in memory before the spool spills to a file.
    :param spill_dir: where spill files go (default: the system temp dir).
    """

    def __init__(self, memory_items: int = DEFAULT_MEMORY_ITEMS, spill_dir: str | os.PathLike[str] | None = None):
        if memory_items < 1:
            raise ValueError("memory_items must be at least 1")
        self.memory_items = memory_items
        self.spill_dir = spill_dir
        self._memory: list[TransactionItem] = []
        self._spill_path: Path | None = None
        self._spill_file: IO[str] | None = None
        self._spilled = 0
        self._source: Path | None = None  # a saved spool read back lazily
        self._source_count = 0

    def __len__(self) -> int:
        return self._source_count + self._spilled + len(self._memory)

    @property
    def spilled(self) -> bool:
        return self._spilled > 0

    def append(self, item: TransactionItem) -> None:
        memory = self._memory
        memory.append(item)
        if len(memory) >= self.memory_items:
            self._spill()

    def _spill(self) -> None:
        where = self._spill_path or self.spill_dir or tempfile.gettempdir()
        with staging_io(where, "spill a large transaction to"):
            if self._spill_file is None:
                fd, name = tempfile.mkstemp(prefix="pgdecode-spool-", suffix=".jsonl", dir=self.spill_dir)
                self._spill_path = Path(name)
                self._spill_file = os.fdopen(fd, "w", encoding="utf-8")
            write = self._spill_file.write
            for item in self._memory:
                write(json.dumps(item_to_json(item), ensure_ascii=False, separators=(",", ":")))
                write("\n")
        self._spilled += len(self._memory)
        self._memory.clear()

    def __iter__(self) -> Iterator[TransactionItem]:
        if self._source is not None:
            with gzip.open(self._source, "rt", encoding="utf-8") as f:
                for line in f:
                    yield item_from_json(json.loads(line))
        if self._spill_file is not None:
            with staging_io(self._spill_path or "", "spill a large transaction to"):
                self._spill_file.flush()
            with open(self._spill_path, encoding="utf-8") as f:  # type: ignore[arg-type]
                for line in f:
                    yield item_from_json(json.loads(line))
        yield from self._memory

    def truncate(self, count: int) -> None:
        """Keep only the first ``count`` items (a streamed subtransaction was rolled back)."""
        if count >= len(self):
            return
        if self._source is None and count >= self._spilled:
            del self._memory[count - self._spilled :]
            return
        # Rare: the cut falls inside spilled or loaded data. Copy the kept items to a new spill.
        kept = ItemSpool(self.memory_items, self.spill_dir)
        for index, item in enumerate(self):
            if index >= count:
                break
            kept.append(item)
        self.discard()
        self._source, self._source_count = None, 0
        self._memory, self._spill_path, self._spill_file, self._spilled = (
            kept._memory,
            kept._spill_path,
            kept._spill_file,
            kept._spilled,
        )

    def save(self, path: str | os.PathLike[str]) -> int:
        """Write every item to ``path`` (gzip JSON lines); return how many were written."""
        count = 0
        # mtime=0: the same items give the same bytes (batches are reproducible).
        with (
            staging_io(path, "write prepared transaction"),
            open(path, "wb") as raw,
            gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=3, mtime=0) as gz,
        ):
            out = io.TextIOWrapper(gz, encoding="utf-8")
            for item in self:
                out.write(json.dumps(item_to_json(item), ensure_ascii=False, separators=(",", ":")))
                out.write("\n")
                count += 1
            out.flush()
            out.detach()
        return count

    @classmethod
    def load(cls, path: str | os.PathLike[str], count: int, memory_items: int = DEFAULT_MEMORY_ITEMS) -> ItemSpool:
        """A spool over a file written by :meth:`save`, read lazily when iterated."""
        if not Path(path).is_file():
            raise FileNotFoundError(f"spooled transaction data is missing: {path}")
        spool = cls(memory_items)
        spool._source = Path(path)
        spool._source_count = count
        return spool

    def discard(self) -> None:
        """Free memory and remove the spill file (not a saved file it was loaded from)."""
        self._memory.clear()
        if self._spill_file is not None:
            self._spill_file.close()
            self._spill_file = None
            if self._spill_path is not None:
                self._spill_path.unlink(missing_ok=True)
        self._spilled = 0
