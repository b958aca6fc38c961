"""`python -m agent.cli ...`: the same as `edge-agent ...` (scripts and tests run it without the console script)."""

from agent.cli.main import main

main()
