"""The docs' generated parts match the code: docs/python.md's preset buffer tables are what
scripts/preset_buffer_table.py makes from the presets now."""
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent.parent


def test_preset_buffer_tables_match_the_presets():
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "preset_buffer_table.py"), "--check"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr


def test_the_check_fails_when_the_doc_drifts(tmp_path, monkeypatch):
    """The check can fail: a table row edited by hand is caught."""
    sys.path.insert(0, str(REPO / "scripts"))
    import preset_buffer_table as t

    doc = tmp_path / "python.md"
    text = (REPO / "docs" / "python.md").read_text()
    end = text.index(t.END)  # the edit lands inside the generated tables, not in prose after them
    assert "`output_layer.weight`" in text[:end]
    at = text.rindex("`output_layer.weight`", 0, end)  # in the last table
    doc.write_text(text[:at] + "`output_layer.weights`" + text[at + len("`output_layer.weight`"):])
    monkeypatch.setattr(t, "DOC", doc)
    monkeypatch.setattr(sys, "argv", ["preset_buffer_table.py", "--check"])
    assert t.main() == 1
    monkeypatch.setattr(sys, "argv", ["preset_buffer_table.py", "--write"])
    assert t.main() == 0
    assert doc.read_text() == text
