"""Bytes only: the ``.fdl`` codec, msgpack values and messages, streams, the slot layout.

What each module holds::

    framing.py    .fdl's framing without torch: tags by name, the span Encoder, the Decoder
    fdl.py        flodl's .fdl format over tensors: torch dtype tables, Encoder, Decoder
    datafile.py   the data file: .fdl's framing, snapsvc's tags for the dtypes .fdl lacks
    protocol.py   msgpack values (tuples, int keys, tensors refs) and the sidecar's messages
    kinds.py      Counter / OrderedDict / defaultdict: a table beside a plain msgpack tree
    bounded.py    the msgpack reader for untrusted bytes: no recursion, nesting and memory bounded
    streams.py    sources and sinks: plain or gzip, CRC-32 taps, memory readers
    layout.py     where each tensor of a snapshot lives inside a shared-memory slot

Imports: ``snapsvc.errors`` only. Nothing here opens a process or a thread.
framing, layout, protocol, kinds, bounded and streams import no torch: the
writer sidecar uses them.
"""
