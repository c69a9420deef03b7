"""What every rewrite rule may know about the file it rewrites."""

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Finding:
    """An unsupported construct, reported by name instead of being silently mangled."""

    file: str
    scope: str  # class or function
    line: int
    what: str
    rule: str = ""  # id of the rule that refused

    def __str__(self) -> str:
        by = f" [{self.rule}]" if self.rule else ""
        return f"{self.file}:{self.line} in {self.scope}: {self.what}{by}"


@dataclass
class RewriteContext:
    entry_class: str  # the *ForCausalLM class the runtime instantiates
    config_module: str = ""  # import name of the vendored configuration module
    config_rename: tuple[str, str] | None = None  # (config class imported, the vendored one's) if they differ
    hf_package: str = ""  # e.g. "transformers.models.llama", for `from .x import y`
    kv_layout: str = "paged"  # "paged" | "legacy"
    checkpoint_config: Any = None  # the checkpoint's transformers config, when there is a checkpoint
    filename: str = "modeling.py"
    source: str = ""  # the file as transformers wrote it, before any rule ran
    findings: list[Finding] = field(default_factory=list)
    scope_lines: dict[str, int] = field(default_factory=dict)  # class / function name -> line in the source
    rule: str = ""  # id of the rule running now
    applied: list[str] = field(default_factory=list)  # ids of the rules that changed this file, in order

    def unsupported(self, scope: str, line: int, what: str) -> None:
        self.findings.append(
            Finding(self.filename, scope, line or self.scope_lines.get(scope, 0), what, self.rule)
        )
