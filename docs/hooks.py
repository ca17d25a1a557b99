"""mkdocs hooks (mkdocs.yml ``hooks:``): README.md as the home page, and a strict API page.

- The site's home page is README.md, its ``docs/`` links made relative to the site, so the
  README is written once and reads the same on GitHub; a page's links to ``../README.md``
  point at the home page.
- The API page (api.md) must document every public name: a name of ``snapsvc.__all__``
  (or of ``snapsvc.distributed``, ``snapsvc.lightning``, ``snapsvc.transformers``) missing
  from its ``:::`` lines, a documented name without a docstring, or a public method or
  property of a documented class without one, is a warning, so ``mkdocs build --strict``
  fails on it.
- Sphinx roles in docstrings (``:class:`~snapsvc.X```) are shown as code.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger(f"mkdocs.plugins.{__name__}")

ROOT = Path(__file__).resolve().parent.parent
API_PAGE = "api.md"
# the modules whose public names the API page must cover
PUBLIC = ("snapsvc", "snapsvc.distributed", "snapsvc.dcp", "snapsvc.lightning", "snapsvc.transformers")
_DIRECTIVE = re.compile(r"^:::\s*([\w.]+)", re.M)
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def on_config(config: Any) -> Any:
    """Document this tree's snapsvc, whatever else is installed (set here: mkdocs restores
    ``sys.path`` after loading hooks)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return config


def on_files(files: Files, config: Any) -> Files:
    """Add the home page, made from README.md."""
    text = (ROOT / "README.md").read_text()
    text = re.sub(r"\]\(docs/", "](", text)
    files.append(File.generated(config, "index.md", content=text))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri != "index.md":
        markdown = markdown.replace("](../README.md", "](index.md")
    if page.file.src_uri == API_PAGE:
        _check_api(markdown)
    return markdown


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri != API_PAGE:
        return html
    return _ROLE.sub(_code, html)


def _code(role: re.Match[str]) -> str:
    """``:class:`~a.b.C``` -> ``C``; ``:mod:`a.b``` -> ``a.b``, as Sphinx shows them."""
    tilde, target = role.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def _check_api(markdown: str) -> None:
    documented = _DIRECTIVE.findall(markdown)
    for path in documented:
        obj = _resolve(path)
        if obj is None:
            log.warning("api.md documents %s, which does not import", path)
            continue
        if not _doc(obj):
            log.warning("api.md: %s has no docstring", path)
        if inspect.isclass(obj):
            for name, member in vars(obj).items():
                if name.startswith("_") or not (callable(member) or isinstance(member, property)):
                    continue
                if not _doc(member.fget if isinstance(member, property) else member):
                    log.warning("api.md: %s.%s has no docstring", path, name)
    seen = {id(_resolve(p)) for p in documented}
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if (callable(obj) or inspect.isclass(obj)) and id(obj) not in seen:
                log.warning("api.md does not document %s.%s (public: in its __all__)",
                            module_name, name)


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _doc(obj: Any) -> str:
    """``obj``'s own docstring, or "" (a dataclass's generated signature is none)."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    doc = (getattr(obj, "__doc__", None) or "").strip()
    if dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
        return ""
    return doc
