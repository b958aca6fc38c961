"""The control plane: the typed command table that MQTT and the local socket share (`commands`, its args models
in `command_args`), remembered replies by request id (`reply_store`), rate limits (`rate_limit`) and the local
socket's server (`control_socket`). Errors as they go on the wire are `agent.base.wire_errors`, a leaf: MQTT and
adaptation use them too. The agent's side of each command is `agent.daemon.control.AgentController`."""
