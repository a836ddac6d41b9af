"""Detokenizers that undo a corpus's tokenized spacing before a tokenizer sees it.

LM1B's sentences come word-tokenized (``he said , " yes " .``); the MDLM / BD3LM reference code
rewrites them before WordPiece, so its LM1B numbers are on text with ordinary spacing. The rules,
in order (the same as the reference's):

1. ``http : / /`` and ``https : / /`` become ``http://`` and ``https://``;
2. a space before an apostrophe that starts a word goes (``it 's`` -> ``it's``);
3. a space before a period after a word goes, mid-sentence and at the end;
4. a space before ``?`` and ``!`` goes;
5. spaces before ``,``, ``:``, ``;`` go, and around ``/``;
6. the spaces inside paired double and single quotes, parentheses and brackets go;
7. the space after ``$`` and ``£`` goes.
"""

from __future__ import annotations

import re

_RULES = [
    (re.compile(r"(https?) : / / "), r"\1://"),
    (re.compile(r" '(\w+)"), r"'\1"),
    (re.compile(r" (\w+) \. "), r" \1. "),
    (re.compile(r" (\w+) \.$"), r" \1."),
    (re.compile(r" \? "), "? "),
    (re.compile(r" \?$"), "?"),
    (re.compile(r" ! "), "! "),
    (re.compile(r" !$"), "!"),
    (re.compile(r" , "), ", "),
    (re.compile(r" : "), ": "),
    (re.compile(r" ; "), "; "),
    (re.compile(r" / "), "/"),
    (re.compile(r'" ([^"]+) "'), r'"\1"'),
    (re.compile(r"' ([^']+) '"), r"'\1'"),
    (re.compile(r"\( ([^()]+) \)"), r"(\1)"),
    (re.compile(r"\[ ([^\[\]]+) \]"), r"[\1]"),
    (re.compile(r"\$ "), "$"),
    (re.compile(r"£ "), "£"),
]


def lm1b(text: str) -> str:
    """One LM1B sentence with ordinary spacing (the rules above)."""
    for pattern, repl in _RULES:
        text = pattern.sub(repl, text)
    return text


DETOKENIZERS = {"lm1b": lm1b}
