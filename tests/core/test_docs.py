from pathlib import Path

from whetstone.config_reference import render, render_task_record

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_configuration_reference_is_current():
    # Regenerate with: python -m whetstone.config_reference > docs/configuration.md
    assert (DOCS / "configuration.md").read_text() == render()


def test_every_config_field_has_a_description():
    missing = [
        line.split("|")[1].strip()
        for line in render().splitlines()
        if line.startswith("| `") and line.rstrip().endswith("|  |")
    ]
    assert not missing, f"fields without a docstring: {missing}"


def test_task_field_table_is_current():
    # Regenerate with: python -m whetstone.config_reference task (between the markers in docs/tasks.md)
    page = (DOCS / "tasks.md").read_text()
    start = page.index("<!-- generated: python -m whetstone.config_reference task -->\n")
    end = page.index("<!-- end generated -->")
    assert page[start:end].split("\n", 1)[1] == render_task_record()


def test_readme_overrides_are_real_keys():
    """Every `whetstone COMMAND ... --set KEY=VALUE` the README shows loads into that command's config."""
    import importlib
    import re

    from whetstone.config import load_config
    from whetstone.config_reference import COMMANDS

    configs = {
        title.split()[1]: (module, name) for title, module, name in COMMANDS if re.fullmatch(r"whetstone \w+", title)
    }
    readme = (DOCS.parent / "README.md").read_text()
    shown = [
        (match[1], override)
        for match in re.finditer(r"whetstone (\w+)((?: [^`\s]+)*)", readme)
        for override in re.findall(r"--set (\S+)", match[2])
    ]
    assert len(shown) >= 3, shown
    for command, override in shown:
        module, name = configs[command]
        load_config(getattr(importlib.import_module(module), name), None, [override])
