"""source_parsing.parse: the same tree as ast.parse, and the collector's state is restored."""

from __future__ import annotations

import ast
import gc

import pytest

from spec_compat.adapters import source_parsing


def test_parse_matches_ast_and_restores_gc() -> None:
    source = "def f(x):\n    return x + 1\n"
    assert ast.dump(source_parsing.parse(source)) == ast.dump(ast.parse(source))
    assert gc.isenabled()
    gc.disable()
    try:
        source_parsing.parse(source)
        assert not gc.isenabled(), "a collector the caller disabled stays disabled"
    finally:
        gc.enable()
    with pytest.raises(SyntaxError):
        source_parsing.parse("def (")
    assert gc.isenabled(), "re-enabled after a failed parse too"
