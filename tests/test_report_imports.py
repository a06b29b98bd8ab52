"""A study's report renders from its records alone: the tables and plots import no training layer."""

import subprocess
import sys


def test_rendering_a_report_imports_neither_lightning_nor_the_training_layer():
    code = ("import sys; import lm.studies.report; "
            "print(sorted({m.split('.')[0] if m.startswith('lightning') else m for m in sys.modules "
            "if m.startswith(('lightning', 'pytorch_lightning', 'lm.training'))}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
