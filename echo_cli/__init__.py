"""The `echo-rl` command line: typer commands, TOML config loading with CLI overrides, rich output."""
