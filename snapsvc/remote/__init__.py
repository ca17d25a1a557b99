"""The remote tier: every checkpoint also copied to object storage or a mounted directory.

What each module holds::

    store.py     where copies live: obstore for s3://, gs://, az://; durable files for a directory
    upload.py    Uploader: the thread of the writer sidecar that copies each durable checkpoint
    fetch.py     a remote checkpoint as a checked local copy, for load/restore/verify by URL
    listing.py   the complete checkpoints of each tier (``snapsvc ls``)

Imports: ``files``, ``format`` and ``errors``. obstore is imported only when an
object store is used (``pip install 'snapsvc[remote]'``), and only in the
process that uses it: its clients hang in a forked child.
"""

from .fetch import accepts_url, fetched, verify
from .store import Store, is_url, open_store
from .upload import Uploader

__all__ = ["Store", "Uploader", "accepts_url", "fetched", "is_url", "open_store", "verify"]
