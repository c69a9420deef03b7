"""The README's main job: export the shipped SmolLM2-135M-Instruct, migrate it with `skill migrate`,
run it on the runtime and print the answer plus the baseline table."""

import subprocess
import sys
from pathlib import Path

from export_smollm2 import default_export_dir, export

REPO = Path(__file__).resolve().parent.parent
PROMPT = "What is the capital of France?"


def main() -> int:
    checkpoint = export(default_export_dir())
    skill = Path(sys.executable).with_name("skill")
    return subprocess.call(
        [
            str(skill),
            "migrate",
            str(checkpoint),
            "-o",
            str(REPO / "models"),
            "--name",
            "smollm2_135m_instruct",
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "32",
            "--force",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
