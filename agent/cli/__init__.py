"""The command line (`edge-agent`): every module a person or a script drives the agent through.

`main` is the typer app and its top-level commands; `engines_cli` and `deploy_cli` are its `engines` and `deploy`
groups; `status` renders what the daemon reports; `bench` and `config_docs` are one-shot tools. Nothing in
the daemon (agent.daemon) or below imports this package: a command line may change without touching the frame path.
"""
