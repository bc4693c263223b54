from vlmstream.cli.main import main

main()
