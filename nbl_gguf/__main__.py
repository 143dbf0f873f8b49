from nbl_gguf.cli import program

program()
