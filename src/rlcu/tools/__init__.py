"""Tools for multi-turn RL (issue 36): tool schemas from Python functions, tool calls parsed from
each family's chat format and run under a time limit."""
