"""What a global batch is made of: the distinct documents its samples read (tools/inspect_data.py).

A batch of consecutive windows of one book gives correlated gradients; the blend's shuffled sample order
(megatron_lite.data.blend) makes a batch draw from across every source. This counts it from the index alone
(no token is read): draw j of source i starts at ``sample_idx_i[j]`` = (position in ``doc_order_i``, offset) and
reads seq_length + 1 tokens, through as many stream documents as they span.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def sample_documents(doc_order: np.ndarray, stream_lengths: np.ndarray, position: int, offset: int,
                     seq_length: int) -> list[int]:
    """Document ids one sample reads: from stream position ``position`` at token ``offset``, seq_length + 1 tokens.

    doc_order: (E*M,) the source's stream of document ids; stream_lengths: (E*M,) their token counts."""
    documents, needed = [], seq_length + 1
    while needed > 0:
        documents.append(int(doc_order[position]))
        needed -= int(stream_lengths[position]) - offset
        position, offset = position + 1, 0
    return documents


def documents_per_batch(arrays: Mapping[str, np.ndarray], doc_lengths: Sequence[np.ndarray], seq_length: int,
                        batch_size: int) -> np.ndarray:
    """(batches, sources) distinct documents of each source read by each complete batch of ``batch_size``
    consecutive samples of a blend index (its ``arrays``; doc_lengths[i]: (documents,) tokens per document of
    source i). A row's sum is the batch's distinct documents."""
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size}: must be positive")
    blend_source, blend_sample = arrays["blend_source"], arrays["blend_sample"]
    streams = {}  # source -> (doc_order, stream_lengths), built on first use
    counts = []
    for start in range(0, len(blend_source) - batch_size + 1, batch_size):
        seen: set[tuple[int, int]] = set()
        for k in range(start, start + batch_size):
            source = int(blend_source[k])
            if source not in streams:
                doc_order = np.asarray(arrays[f"doc_order_{source}"])
                streams[source] = (doc_order, np.asarray(doc_lengths[source], dtype=np.int64)[doc_order])
            position, offset = (int(v) for v in arrays[f"sample_idx_{source}"][int(blend_sample[k])])
            seen.update((source, d) for d in sample_documents(*streams[source], position, offset, seq_length))
        counts.append(np.bincount([source for source, _ in seen], minlength=len(doc_lengths)))
    return np.asarray(counts, dtype=np.int64).reshape(-1, len(doc_lengths))
