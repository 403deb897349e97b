from genrl.cli import main

main()
