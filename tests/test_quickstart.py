"""The README's demo runs and checks itself against eager."""
import runpy
from pathlib import Path


def test_quickstart(capsys):
    runpy.run_path(str(Path(__file__).parent.parent / "examples" / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "outputs match eager" in out and "fused regions" in out
