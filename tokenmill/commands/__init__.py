"""The ``tokenmill`` subcommands (the top layer): each module has add_arguments(parser) and run(args)."""
