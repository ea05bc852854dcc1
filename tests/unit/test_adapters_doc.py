"""docs/adapters.md is what the registry says (tools/adapters_doc.py renders it)."""

from __future__ import annotations

import adapters_doc

from spec_compat.registry import ADAPTERS


def test_the_page_is_rendered_from_the_registry() -> None:
    page = adapters_doc.PAGE.read_text()
    assert page == adapters_doc.render(), "docs/adapters.md is out of date: run python3 tools/adapters_doc.py"
    for unit in ADAPTERS:
        assert f"## {unit.id}\n" in page and f"- delete when: {unit.delete_when}\n" in page
