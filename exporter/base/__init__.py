"""What every layer may use: background-task supervision, the protocol-error tally, logging
and the audit record, the event-loop choice, free loopback ports. Knows no engine and no HTTP.
"""
