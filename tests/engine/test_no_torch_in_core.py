"""The scheduler core imports no torch: the simulator and operator use it without a GPU stack."""

import subprocess
import sys


def test_scheduler_and_kv_manager_import_without_torch():
    code = (
        "import sys\n"
        "import tandem.engine.scheduler, tandem.engine.kv_manager, tandem.engine.step_vote\n"
        "import tandem.engine.step_result\n"
        "from tandem.engine import SamplingParams\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
