from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec_compat.versions import at_least, parse_version


@pytest.mark.parametrize(
    ("raw", "kind", "release", "sha", "accelerator"),
    [
        ("0.32.0", "release", (0, 32, 0), None, None),
        ("0.16.0rc2", "rc", (0, 16, 0), None, None),
        ("0.16.0rc2.dev123+g1a2b3c", "dev", (0, 16, 0), "1a2b3c", None),
        ("0.16.0+cu129", "release", (0, 16, 0), None, "cu129"),
        ("0.11.1rc6.dev16+g933cdea44.cu129", "dev", (0, 11, 1), "933cdea44", "cu129"),
        ("0.25.2.dev0+g752a3a504.d20260720", "dev", (0, 25, 2), "752a3a504", None),
        ("0.1.dev1+gabcdef0", "source", (0, 1), "abcdef0", None),
        ("0.32.0+cpu", "release", (0, 32, 0), None, "cpu"),
        ("dev", "unknown", (), None, None),
        ("", "unknown", (), None, None),
    ],
)
def test_parse_known_strings(
    raw: str, kind: str, release: tuple[int, ...], sha: str | None, accelerator: str | None
) -> None:
    parsed = parse_version(raw)
    assert (parsed.kind, parsed.release, parsed.git_sha, parsed.accelerator) == (kind, release, sha, accelerator)


def test_nightly_counts_as_its_release_line() -> None:
    # PEP 440 orders 0.17.0rc1.dev5 before 0.17.0; the nightly carries 0.17's changes all the same.
    assert at_least(parse_version("0.17.0rc1.dev5+gabc1234"), "0.17.0") is True
    assert at_least(parse_version("0.16.0+cu129"), "0.17.0") is False
    assert at_least(parse_version("0.1.dev1+gabc1234"), "0.11.0") is None
    assert at_least(parse_version("dev"), "0.11.0") is None


@given(
    st.tuples(st.integers(0, 99), st.integers(0, 99), st.integers(0, 99)),
    st.one_of(st.none(), st.integers(0, 9)),
    st.one_of(st.none(), st.integers(0, 999)),
    st.one_of(st.none(), st.text("0123456789abcdef", min_size=7, max_size=12)),
    st.sampled_from([None, "cu129", "cu130", "cpu", "rocm6"]),
)
def test_parser_roundtrip(
    release: tuple[int, int, int], rc: int | None, dev: int | None, sha: str | None, acc: str | None
) -> None:
    text = ".".join(map(str, release))
    if rc is not None:
        text += f"rc{rc}"
    if dev is not None:
        text += f".dev{dev}"
    local = [p for p in (f"g{sha}" if sha else None, acc) if p]
    if local:
        text += "+" + ".".join(local)
    parsed = parse_version(text)
    assert parsed.is_known and parsed.release[:3] == release[: len(parsed.release)]
    assert parsed.git_sha == sha and parsed.accelerator == acc
    expected_kind = "dev" if dev is not None else "rc" if rc is not None else "release"
    if release[:2] == (0, 1) and dev is not None and sha:
        expected_kind = "source"
    assert parsed.kind == expected_kind


@given(st.text(max_size=30))
def test_parser_never_raises(raw: str) -> None:
    parsed = parse_version(raw)
    assert parsed.kind in {"release", "rc", "dev", "source", "unknown"}
