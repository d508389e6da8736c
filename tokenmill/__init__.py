"""tokenmill: the command line, configuration and process supervision that tie the packages together."""
