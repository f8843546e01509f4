"""The controller: run spec, planning, placement, launching, run state machine, CLI and REST API."""
