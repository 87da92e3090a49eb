"""Megatron's WikiText detokenizer (``tasks/zeroshot_gpt/detokenizer.py``), rule for rule.

WikiText-103 ships pre-tokenized text (``word @-@ word``, ``end .``); GPT models
were trained on ordinary text, so Megatron undoes the markup before tokenizing.
The order of the replacements matters and is Megatron's (the same function is
in Transformer-XL and lm-evaluation-harness), including its quirks: the regex
on ``/' [0-9]/`` matches only literal slashes, and bracket/quote regexes strip
the spaces inside the first and last pair they see on a span. Do not "fix"
them: perplexities would stop being comparable with published numbers.
"""

from __future__ import annotations

import re


def wikitext_detokenize(string: str) -> str:
    """WikiText markup → ordinary text, exactly as Megatron-LM's ``wikitext_detokenizer``."""
    # contractions
    string = string.replace("s '", "s'")
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    # number separators
    string = string.replace(" @-@ ", "-")
    string = string.replace(" @,@ ", ",")
    string = string.replace(" @.@ ", ".")
    # punctuation
    string = string.replace(" : ", ": ")
    string = string.replace(" ; ", "; ")
    string = string.replace(" . ", ". ")
    string = string.replace(" ! ", "! ")
    string = string.replace(" ? ", "? ")
    string = string.replace(" , ", ", ")
    # double brackets
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    # miscellaneous
    string = string.replace("= = = =", "====")
    string = string.replace("= = =", "===")
    string = string.replace("= =", "==")
    string = string.replace(" " + chr(176) + " ", chr(176))
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" N ", " 1 ")
    string = string.replace(" 's", "'s")
    return string
