"""The rule catalogue: every migrate / parallelize rule is a codemod with a stable id and a one-line
description, `--list-rules` prints them in order, `--disable ID` skips one, and each rule has its
before / after, idempotency and no-op tests in tests/rules or tests/parallel_rules."""

import re
from pathlib import Path

import migrated_code
import pytest
from skill_process import skill

from runtime.errors import UserError
from skills.migrator.pipeline import convert_code
from skills.migrator.rule import Rule
from skills.migrator.rules import CONFIGURATION_RULES, MIGRATE_RULES, MODELING_RULES
from skills.parallel_impl.rules import PARALLEL_RULES

TESTS = Path(__file__).parent
ALL = [*MIGRATE_RULES, *PARALLEL_RULES]


def test_ids_are_unique_and_listed_in_the_order_of_application():
    """Ids are stable (a new rule takes the next free number wherever it runs); MIGRATE_RULES, which
    --list-rules prints, is the modeling file's order followed by the configuration-only rules."""
    assert len({r.ID for r in ALL}) == len(ALL)
    for rules, prefix in ((MIGRATE_RULES, "MG"), (PARALLEL_RULES, "PR")):
        assert all(re.fullmatch(rf"{prefix}\d{{3}}", r.ID) for r in rules)
    assert MIGRATE_RULES[: len(MODELING_RULES)] == MODELING_RULES
    assert set(MIGRATE_RULES) == {*MODELING_RULES, *CONFIGURATION_RULES}
    for rule in ALL:
        assert issubclass(rule, Rule) and "\n" not in rule.DESCRIPTION and len(rule.DESCRIPTION) <= 100


@pytest.mark.parametrize("rule", ALL, ids=lambda r: r.ID)
def test_every_rule_has_before_after_idempotency_and_noop_tests(rule):
    folder = TESTS / ("parallel_rules" if rule in PARALLEL_RULES else "rules")
    owners = [
        p
        for p in folder.glob("test_*.py")
        if re.search(rf"\bimport {rule.__name__} as rule\b", p.read_text())
    ]
    assert len(owners) == 1, f"{rule.ID} {rule.__name__} needs one test module in {folder}"
    tests = owners[0].read_text()
    assert "assert_codemod(" in tests or "def test_idempotent" in tests, (
        f"{owners[0].name}: no idempotency test"
    )
    assert "assert_noop(" in tests or re.search(r"def test_\w*untouched", tests), (
        f"{owners[0].name}: no no-op test"
    )


@pytest.mark.parametrize("command,rules", [("migrate", MIGRATE_RULES), ("parallelize", PARALLEL_RULES)])
def test_list_rules(command, rules):
    proc = skill(command, "--list-rules")
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[:2] for line in proc.stdout.splitlines()] == [[r.ID, r.__name__] for r in rules]


def test_disable_skips_a_rule_and_the_result_says_which_rules_ran():
    src = migrated_code.source("llama")
    full = convert_code(src, "llama", "paged")
    without = convert_code(src, "llama", "paged", disabled={"MG012"})
    modeling = "models/modeling_llama.py"
    assert "MG012" in full.rules[modeling] and "MG012" not in without.rules[modeling]
    assert "self.layer_idx = layer_idx" in without.files[modeling]
    assert "self.layer_idx" not in full.files[modeling]
    with pytest.raises(UserError, match="--disable MG999: no such rule; the rules are MG001, "):
        convert_code(src, "llama", "paged", disabled={"MG999"})
