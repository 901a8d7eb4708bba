"""Repository contract: the README starts with the two commands, and CI runs the test one verbatim."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands() -> list[str]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_starts_with_two_commands_and_ci_runs_the_test_one():
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert "hf_xmc.quickstart" in commands[0] and "pytest" in commands[1]
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert commands[1] in ci.splitlines()

