"""The peer comparison's page writer (bench/peers/doc.py) regenerates only docs/benchmarks.md's
head: every section from its keep-marker on stays as written, and a page without the marker is
refused rather than cut short (it once dropped every hand-written section)."""
import pytest

from bench.peers import doc


@pytest.fixture
def page(tmp_path, monkeypatch):
    """A page of its own, written from the stored results (read only; no plot drawn)."""
    monkeypatch.setattr(doc, "_plot", lambda *args: None)
    path = tmp_path / "benchmarks.md"
    monkeypatch.setattr(doc, "DOC", str(path))
    return path


def test_the_hand_written_sections_survive_a_rewrite(page):
    hand_written = f"{doc.KEEP_MARKER}\n\n## My benchmark\n\nfigures\n"
    page.write_text("# old head\n\n| planserve | 1.0 |\n\n" + hand_written)
    doc.write_doc()
    text = page.read_text()
    assert text.endswith(hand_written)
    assert "old head" not in text and "## Offline: the peer workload" in text
    doc.write_doc()  # twice: the same page
    assert page.read_text() == text


def test_a_page_without_the_marker_is_refused_and_left_alone(page):
    page.write_text("# head\n\n## A hand-written section\n")
    with pytest.raises(SystemExit, match="lacks the line"):
        doc.write_doc()
    assert page.read_text() == "# head\n\n## A hand-written section\n"


def test_a_new_page_gets_the_marker(page):
    doc.write_doc()
    assert page.read_text().rstrip().endswith(doc.KEEP_MARKER)
