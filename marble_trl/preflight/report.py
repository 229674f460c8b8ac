"""What ``marble-trl check`` found: findings (an error, a warning or a note, each with the fix when there is one),
the tables it prints, and the exit code (non-zero when any error was found)."""

from __future__ import annotations

from dataclasses import dataclass, field

LEVELS = ("error", "warning", "note")


@dataclass(frozen=True)
class Finding:
    level: str  # one of LEVELS
    topic: str  # "config", "model", "lora", "rewards", "batching", "memory", "measure"
    message: str
    fix: str | tuple[str, ...] | None = None  # several: to apply together, in order

    @property
    def fix_list(self) -> tuple[str, ...]:
        return () if self.fix is None else (self.fix,) if isinstance(self.fix, str) else tuple(self.fix)


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    sections: list[tuple[str, list[str]]] = field(default_factory=list)  # (title, lines) printed in order

    def add(self, level: str, topic: str, message: str, fix: str | tuple[str, ...] | None = None) -> None:
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        self.findings.append(Finding(level, topic, message, fix))

    def error(self, topic: str, message: str, fix: str | tuple[str, ...] | None = None) -> None:
        self.add("error", topic, message, fix)

    def warning(self, topic: str, message: str, fix: str | tuple[str, ...] | None = None) -> None:
        self.add("warning", topic, message, fix)

    def note(self, topic: str, message: str) -> None:
        self.add("note", topic, message)

    def section(self, title: str, lines: list[str]) -> None:
        self.sections.append((title, lines))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def exit_code(self) -> int:
        return 1 if self.errors else 0

    def fixes(self) -> list[str]:
        """The distinct fixes of the errors, then of the warnings, in the order found."""
        out: list[str] = []
        for level in ("error", "warning"):
            for f in self.findings:
                if f.level == level:
                    out += [fix for fix in f.fix_list if fix not in out]
        return out

    def lines(self) -> list[str]:
        out: list[str] = []
        for title, lines in self.sections:
            out += [f"## {title}", "", *lines, ""]
        for level, title in (("error", "Errors"), ("warning", "Warnings"), ("note", "Notes")):
            found = [f for f in self.findings if f.level == level]
            if found:
                out += [f"## {title}", ""]
                out += [f"- [{f.topic}] {f.message}" for f in found]
                out.append("")
        fixes = self.fixes()
        if fixes:
            out += ["## Fixes", ""] + [f"{i}. {fix}" for i, fix in enumerate(fixes, 1)] + [""]
        n_err, n_warn = len(self.errors), sum(f.level == "warning" for f in self.findings)
        if n_err:
            out.append(
                f"[marble-trl check] FAILED: {n_err} error(s), {n_warn} warning(s); the fixes are listed above."
            )
        else:
            out.append(f"[marble-trl check] OK: no error, {n_warn} warning(s).")
        return out
