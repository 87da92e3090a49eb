"""`python -m mg.corpus_prep` is `mg-prep`."""

from mg.corpus_prep.cli import main

main()
