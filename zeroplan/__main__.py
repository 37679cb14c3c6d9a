from zeroplan.cli.main import command

command()
