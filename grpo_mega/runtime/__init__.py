"""What a running process is and says: the console (quiet third-party logging, progress
bars), the lifeline that stops a rank whose launcher is gone, fault injection for tests
at named points of a step, and the glossary of every metric a run logs.

Imports nothing of ours outside this package, so any part (the trainer, the rollout
servers, the reward sandbox) may use it.
"""
