"""The remote tier: every checkpoint also copied to object storage or a mounted directory.

- :mod:`.store`: where copies live (obstore for ``s3://``, ``gs://``, ``az://``;
  plain durable files for a directory);
- :mod:`.upload`: the uploader thread the writer sidecar runs;
- :mod:`.fetch`: reading a remote checkpoint for ``load``/``restore``/``verify``.

obstore is imported only when an object store is used (``pip install 'snapsvc[remote]'``).
"""

from .fetch import accepts_url, fetched
from .store import Store, is_url, open_store
from .upload import Uploader

__all__ = ["Store", "Uploader", "accepts_url", "fetched", "is_url", "open_store"]
