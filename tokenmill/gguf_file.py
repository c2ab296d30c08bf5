"""A GGUF file's reader, parsed once per process: the engine reads a file's config and then its weights, the
tokenizer its chat template, and every further LLM over the file all of it again, while parsing the metadata
takes seconds for a large vocabulary (Gemma 3's 262k tokens: ~20 s on 2 loaded cores). Imports no torch: the API
server loads tokenizers too."""
from __future__ import annotations

import functools
import os

import numpy as np


def gguf_reader(path: str):
    """The file's gguf.GGUFReader, shared while the file is unchanged (same path, size and mtime)."""
    st = os.stat(path)
    return _cached_reader(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)  # a model and its draft model
def _cached_reader(path: str, size: int, mtime_ns: int):
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """gguf's reader over a plain ndarray view of its np.memmap. The reader slices the map once per value
        (twice per vocabulary string), and every np.memmap slice runs memmap's Python __array_finalize__: 2.1 s
        of the default model's 2-core start-up in each process that reads the file, 0.7 s over the plain view.
        Same bytes, still mapped (the view keeps the map alive), tensors still zero-copy."""

        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return Reader(path)


def forget_readers() -> None:
    """Drops the shared readers, and with them the files' mappings once nothing else holds a view of them: the
    pages the loader read count in the process's RSS while mapped (sleep level 2 frees the weights)."""
    _cached_reader.cache_clear()
