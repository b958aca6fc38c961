"""The agent's floor: small leaves any part of the agent may import (default paths, name patterns, addresses,
redaction, the wire's error texts, systemd notify and logging, the crash hooks tests use). They import nothing
of the agent, so a wing can use them without pulling in another wing."""
