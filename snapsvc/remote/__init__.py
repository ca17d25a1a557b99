"""The remote tier: every checkpoint also copied to object storage or a mounted directory.

What each module holds::

    url.py       remote URLs and keys, read and quoted in one place; messages without secrets
    store.py     where copies live: obstore for s3://, gs://, az://; durable files for a directory
    upload.py    Uploader: the thread of the writer sidecar that copies each durable checkpoint
    upkeep.py    the uploader's start-up round (leftovers, catch-up) and remote_keep_last
    fetch.py     a remote checkpoint read into memory and checked, for load/restore/verify by URL
    listing.py   the complete checkpoints of each tier (``snapsvc ls``)

Imports: ``files``, ``format`` and ``errors``. obstore is imported only when an
object store is used (``pip install 'snapsvc[remote]'``), and its clients are
used only in the process that made them: they hang in a forked child. (A
writer's construction builds one to check ``remote_options``, which starts no
thread and makes no request.)
"""

from .fetch import accepts_url, fetched, verify
from .store import Store, is_url, open_store
from .upload import Uploader

__all__ = ["Store", "Uploader", "accepts_url", "fetched", "is_url", "open_store", "verify"]
