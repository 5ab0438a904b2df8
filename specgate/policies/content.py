"""What kind of text a request is, for acceptance bookkeeping.

Drafters accept far more of code than of prose (the demo's MTP head: 0.62
vs 0.55 per draft; published DFlash numbers differ more), so one running
acceptance rate per model and method would plan code with prose's numbers
and the other way round. Output held to a grammar (structured outputs,
forced tool calls) is a third class: the grammar fixes many tokens, and
masks the drafts' distributions, so its acceptance is its own. Three
classes keep it bounded: a metric label and a policy key, not a taxonomy.
"""

from __future__ import annotations

from typing import Literal

ContentClass = Literal["code", "prose", "structured"]
CONTENT_CLASSES: tuple[ContentClass, ...] = ("code", "prose", "structured")
_CODE_MARKS = set("{}[]();=<>_#:")
_SAMPLE_CHARS = 4000  # the end of the prompt: what the model continues from


def content_class(text: str) -> ContentClass:
    """'code' when the prompt's tail reads like source code: many of its
    lines indented or ending in a bracket, colon or semicolon, or a high
    share of code punctuation among its non-space characters."""
    tail = text[-_SAMPLE_CHARS:]
    lines = [line for line in tail.splitlines() if line.strip()]
    if not lines:
        return "prose"
    codeish = sum(line.startswith(("    ", "\t")) or line.rstrip()[-1] in "{}():;,[" for line in lines)
    chars = [c for c in tail if not c.isspace()]
    marks = sum(c in _CODE_MARKS for c in chars) / max(1, len(chars))
    return "code" if codeish / len(lines) >= 0.4 or marks >= 0.08 else "prose"
