"""The words tiny-math's problems are written with: the people's names, the nouns of the arithmetic and
comparison problems, the words of the counting lists. data/tiny_math.py writes its problems with them,
data/near_duplicates.py's rule replaces them (a question's structure key)."""

NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena",
         "Mo", "Nia", "Omar", "Pia", "Raj", "Sara", "Tom", "Uma")
THINGS = ("apples", "books", "coins", "marbles", "pencils", "stickers", "shells", "cards", "stamps",
          "buttons")
LIST_WORDS = ("apple", "pear", "plum", "fig", "lime", "kiwi", "grape", "lemon")
